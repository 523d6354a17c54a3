"""Request-level dynamic batching (SynerDiff's baseline) on hand-made snapshots."""

from __future__ import annotations

import random

import pytest

from stepserve.policies import PerWorker, make_policy
from stepserve.policies.dynamic_batching import DynamicBatching, DynamicBatchingConfig

from tests.cpu.policies.snapshots import LARGE, SMALL, only_plan, req, snap, steps


def decide(now, queued=(), workers=None, **config):
    """The policy's Decision for w0; default one idle worker w0, cap 8."""
    snapshot = snap(workers or {"w0": (8, [])}, queued, now=now)
    decision = DynamicBatching(DynamicBatchingConfig(**config)).plan(snapshot, "w0")
    only_plan(decision, "w0")  # at most w0's plan, never an empty one
    return decision


def plan(now, queued=(), workers=None, **config):
    return only_plan(decide(now, queued, workers, **config), "w0")


def test_registered_under_its_name_with_the_paper_window():
    policy = make_policy("dynamic_batching", {"max_batch_size": 4})
    assert isinstance(policy, PerWorker) and isinstance(policy.policy, DynamicBatching)
    assert policy.name == "dynamic_batching"
    assert policy.policy.config == DynamicBatchingConfig(window_s=0.5, max_batch_size=4)


@pytest.mark.parametrize("options", [{"window_s": -0.1}, {"window_s": float("nan")}, {"window_s": True},
                                     {"max_batch_size": 0}, {"window": 0.5}])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError):
        make_policy("dynamic_batching", options)


def test_idle_worker_waits_for_the_window_of_the_oldest_ready_request():
    queued = [req("a", arrival=1.0), req("b", arrival=1.2)]
    d = decide(1.3, queued)
    assert d.plans == ()
    assert d.wake_at == pytest.approx(1.5)  # a's window: 1.0 + 0.5


def test_window_closed_releases_the_batch_of_the_oldest_kind():
    queued = [req("a", arrival=1.0), req("other_steps", arrival=1.1, steps=20), req("b", arrival=1.2),
              req("other_shape", LARGE, arrival=1.3)]
    d = decide(1.5, queued)
    p = only_plan(d, "w0")
    assert p.admit == ("a", "b")
    assert p.groups == steps(("a", "b"))
    assert d.wake_at is None


def test_full_batch_starts_before_its_window_closes():
    queued = [req(f"r{i}", arrival=1.0 + 0.01 * i) for i in range(5)]
    p = plan(1.05, queued, max_batch_size=3)
    assert p.admit == ("r0", "r1", "r2")


def test_a_full_batch_of_a_younger_kind_goes_while_the_oldest_kind_still_waits():
    queued = [req("old", LARGE, arrival=1.0)] + [req(f"s{i}", arrival=1.1 + 0.01 * i) for i in range(2)]
    p = plan(1.2, queued, max_batch_size=2)
    assert p.admit == ("s0", "s1")


def test_not_ready_requests_neither_join_nor_open_a_window():
    queued = [req("encoding", arrival=0.0, ready=False), req("a", arrival=2.0)]
    d = decide(2.1, queued)
    assert d.plans == () and d.wake_at == pytest.approx(2.5)
    assert plan(2.5, queued).admit == ("a",)
    only_encoding = decide(9.0, [req("encoding", arrival=0.0, ready=False)])
    assert only_encoding.plans == () and only_encoding.wake_at is None


def test_nothing_queued_means_no_wake():
    d = decide(3.0)
    assert d.plans == () and d.wake_at is None


def test_running_batch_steps_to_the_end_and_nothing_joins():
    residents = [req("a", steps=20, done=3), req("b", steps=20, done=3)]
    queued = [req("late", arrival=0.0)]  # its window closed long ago
    d = decide(10.0, queued, workers={"w0": (8, residents)})
    p = only_plan(d, "w0")
    assert p.admit == () and p.groups == steps(("a", "b")) and d.wake_at is None


def test_zero_window_is_static_batching():
    queued = [req("a", arrival=5.0), req("b", arrival=5.0)]
    assert plan(5.0, queued, window_s=0.0).admit == ("a", "b")


def test_batch_cap_is_the_smaller_of_config_and_worker():
    queued = [req(f"r{i}", arrival=0.0) for i in range(6)]
    assert plan(1.0, queued, workers={"w0": (4, [])}).admit == ("r0", "r1", "r2", "r3")
    assert plan(1.0, queued, workers={"w0": (4, [])}, max_batch_size=2).admit == ("r0", "r1")


def oracle(now, queued, limit, window):
    """Brute force: the kinds (shape, steps) in order of their oldest ready member; the first
    one that is full or whose window has closed runs; else wait for the earliest window."""
    ready = [r for r in queued if r.ready]
    kinds = []
    for r in ready:
        kind = (r.shape_key, r.steps_total)
        if kind not in kinds:
            kinds.append(kind)
    for kind in kinds:
        members = [r for r in ready if (r.shape_key, r.steps_total) == kind]
        if len(members) >= limit or now >= members[0].arrival_time + window:
            return tuple(r.request_id for r in members[:limit]), None
    closes = [min(r.arrival_time for r in ready if (r.shape_key, r.steps_total) == k) + window for k in kinds]
    return (), (min(closes) if closes else None)


@pytest.mark.parametrize("seed", range(200))
def test_matches_brute_force_on_random_queues(seed):
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, 2) for _ in range(rng.randrange(0, 12)))
    queued = [req(f"r{i}", rng.choice([SMALL, LARGE]), t, rng.random() < 0.8, rng.choice([10, 20]))
              for i, t in enumerate(arrivals)]
    now, limit, window = rng.uniform(0, 3), rng.randrange(1, 6), rng.choice([0.0, 0.25, 0.5, 1.0])
    d = decide(now, queued, max_batch_size=limit, window_s=window)
    p = only_plan(d, "w0")
    admit, wake = oracle(now, queued, limit, window)
    assert p.admit == admit
    assert p.groups == (steps(admit) if admit else ())
    assert d.wake_at == (None if wake is None else pytest.approx(wake))
