"""The shared CPU host: processor sharing by hand, and what it does to a simulated app."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.sim.events import EventQueue
from stepserve.load_tests.sim.host import SharedHost

from tests.cpu.load_tests.costs import ConstantCost
from tests.cpu.load_tests.test_sim import request


def run_jobs(cpus: float, jobs: list[tuple[float, float]]) -> dict[int, float]:
    """Submit (start time, solo seconds) jobs; return each one's completion time."""
    events = EventQueue()
    host = SharedHost(cpus, events)
    done: dict[int, float] = {}
    for index, (start, work) in enumerate(jobs):
        events.at(start, host.run, work, lambda i=index: done.__setitem__(i, events.now))
    events.run()
    return done


def test_jobs_within_the_cores_run_at_full_speed():
    assert run_jobs(2, [(0.0, 1.0), (0.0, 3.0)]) == pytest.approx({0: 1.0, 1: 3.0})


def test_jobs_beyond_the_cores_share_them():
    # Three 1 s jobs on 2 cores: each runs at 2/3 speed and all end at 1.5 s.
    assert run_jobs(2, [(0.0, 1.0)] * 3) == pytest.approx({0: 1.5, 1: 1.5, 2: 1.5})


def test_speed_changes_as_jobs_come_and_go():
    # One core. A (2 s) alone for 1 s (1 s left); B (0.5 s) joins at 1: both at half speed, B
    # ends at 2 (A has 0.5 s left), then A alone ends at 2.5.
    assert run_jobs(1, [(0.0, 2.0), (1.0, 0.5)]) == pytest.approx({0: 2.5, 1: 2.0})


def test_zero_work_calls_back_at_once():
    assert run_jobs(1, [(0.0, 1.0), (0.3, 0.0)]) == pytest.approx({0: 1.0, 1: 0.3})


def test_bad_host():
    with pytest.raises(ValueError, match="cpus"):
        SharedHost(0, EventQueue())
    with pytest.raises(ValueError, match="host_cpus"):
        SimConfig(host_cpus=-1)


def config(workers: int, host_cpus: float | None) -> SimConfig:
    return SimConfig(workers=workers, max_batch_size=8, policy="continuous", pipeline_depth=1,
                     text_encoder=TextEncoderSpec(batch_wait_s=0.0, cache_size=0), decoders=1,
                     host_cpus=host_cpus)


def test_a_host_with_cores_to_spare_changes_nothing():
    requests = [request(i, 0.3 * i, 3) for i in range(6)]
    alone = simulate(requests, ConstantCost(), config(2, None))
    roomy = simulate(requests, ConstantCost(), config(2, 64))
    assert [t.completion_s for t in roomy.traces] == pytest.approx([t.completion_s for t in alone.traces])


def _two_workers(host_cpus: float | None):
    # Rounds cost 1 s. Two requests at 0 are encoded in one batch and land on two workers; on
    # one core their rounds always run together, each at half speed.
    requests = [request(0, 0.0, 2, guidance=1.0), request(1, 0.0, 2, guidance=1.0)]
    return simulate(requests, ConstantCost(decode_s=0.0), config(2, host_cpus))


def test_two_workers_on_one_core_take_twice_as_long():
    own, shared = _two_workers(None), _two_workers(1)
    assert [t.finish_s - t.admit_s for t in own.traces] == pytest.approx([2.0, 2.0])
    assert [t.finish_s - t.admit_s for t in shared.traces] == pytest.approx([4.0, 4.0])
    assert shared.host_peak_jobs == 2


def test_a_worker_on_a_shared_host_is_busy_for_as_long_as_its_rounds_take():
    # Busy time is wall time on the worker (as the live router's round times are), so the
    # shared host shows it busy twice as long.
    own, shared = _two_workers(None), _two_workers(1)
    assert sum(shared.busy_s.values()) == pytest.approx(2 * sum(own.busy_s.values()))


def test_request_overhead_competes_for_the_host():
    # One core; 0.2 s of request overhead (0.1 s each side). A's denoising round (1 s) overlaps
    # B's arrival overhead, which slows it down: A finishes later than without B.
    cost = ConstantCost(overhead_s=0.2, encode_s=0.0, decode_s=0.0)
    alone = simulate([request(0, 0.0, 1)], cost, config(1, 1))
    crowded = simulate([request(0, 0.0, 1), request(1, 0.5, 1)], cost, config(1, 1))
    a_alone, a_crowded = alone.traces[0].finish_s, crowded.traces[0].finish_s
    assert a_alone == pytest.approx(1.1)
    # B's 0.1 s of submit overhead at [0.5, ...] halves A's speed while it lasts: +0.1 s.
    assert a_crowded == pytest.approx(1.2)


def test_busy_cores_slow_each_other():
    # Two cores that run 1.5x slower when both are busy: two 1 s jobs take 1.5 s; a lone one 1 s.
    events = EventQueue()
    host = SharedHost(2, events, slowdown=lambda busy: 1.5 if busy >= 2 else 1.0)
    done: list[float] = []
    host.run(1.0, lambda: done.append(events.now))
    host.run(1.0, lambda: done.append(events.now))
    events.run()
    assert done == pytest.approx([1.5, 1.5])
    host.run(1.0, lambda: done.append(events.now))
    events.run()
    assert done[-1] == pytest.approx(2.5)


def test_a_background_slows_jobs_only_once_the_cores_are_all_wanted():
    # 0.5 cores of background on 2: a lone job has a core to itself, two share 2 / 2.5.
    events = EventQueue()
    host = SharedHost(2, events, background=0.5)
    done: list[float] = []
    host.run(1.0, lambda: done.append(events.now))
    events.run()
    host.run(1.0, lambda: done.append(events.now))
    host.run(1.0, lambda: done.append(events.now))
    events.run()
    assert done == pytest.approx([1.0, 2.25, 2.25])
    with pytest.raises(ValueError, match="background"):
        SharedHost(2, EventQueue(), background=-0.1)


@dataclass(frozen=True)
class HostCost(ConstantCost):
    """A profile that measured the host: the idle app's cores and the router's CPU per step."""

    idle_cores: float = 0.0
    router_cpu_s: float = 0.0

    def host_idle_cores(self) -> float:
        return self.idle_cores

    def router_cpu_seconds(self) -> float:
        return self.router_cpu_s


def test_the_router_cpu_per_step_competes_for_a_shared_host_only():
    # One request of two 1 s steps, a plan each (one at a time); the router spends 0.5 s of CPU
    # on each report. On one core its work on the first report halves the second step's speed
    # until it is done (1 s), then the step's last 0.5 s runs alone: 2.5 s in all. With a core
    # each, or on devices of their own, the steps take 2 s.
    cost = HostCost(encode_s=0.0, decode_s=0.0, router_cpu_s=0.5)
    one_core, two_cores, devices = (simulate([request(0, 0.0, 2)], cost, config(1, cpus)) for cpus in (1, 2, None))
    assert one_core.rounds == 2
    assert [r.traces[0].finish_s - r.traces[0].admit_s for r in (one_core, two_cores, devices)] == \
        pytest.approx([2.5, 2.0, 2.0])


def test_the_idle_app_slows_two_workers_on_two_cores():
    # The _two_workers case on 2 cores with 0.5 cores of idle app: each 1 s round takes 1.25 s.
    requests = [request(0, 0.0, 2, guidance=1.0), request(1, 0.0, 2, guidance=1.0)]
    quiet, busy = (simulate(requests, HostCost(decode_s=0.0, idle_cores=idle), config(2, 2)) for idle in (0.0, 0.5))
    assert [t.finish_s - t.admit_s for t in quiet.traces] == pytest.approx([2.0, 2.0])
    assert [t.finish_s - t.admit_s for t in busy.traces] == pytest.approx([2.5, 2.5])
