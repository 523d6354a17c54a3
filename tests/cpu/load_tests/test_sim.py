"""The discrete-event simulator: exact timelines by hand, determinism, conservation, policies by
name, and how fast it runs."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.workload import (
    PoissonArrivals, RequestClass, ScheduledRequest, SizeChoice, StepsChoice, WorkloadSpec, generate,
)
from stepserve.policies import Decision
from tests.cpu.load_tests.costs import BatchingCost, ConstantCost

MODEL = "sd"
# No batching wait and no cache in the text encoder, so every encode costs exactly encode_s.
PLAIN_ENCODER = TextEncoderSpec(batch_wait_s=0.0, cache_size=0)


def request(index: int, offset: float, steps: int, size: int = 64, guidance: float = 7.5,
            slo: float | None = None) -> ScheduledRequest:
    return ScheduledRequest(index=index, offset_s=offset, num_inference_steps=steps, seed=index, width=size,
                            height=size, guidance_scale=guidance, prompt=f"p{index}", model=MODEL, slo_s=slo)


def one_worker(depth: int, lead: float = 0.05, **kw) -> SimConfig:
    return SimConfig(workers=1, max_batch_size=8, policy="continuous", pipeline_depth=depth, pipeline_lead_s=lead,
                     text_encoder=PLAIN_ENCODER, decoders=1, **kw)


def timeline(result):
    return {t.index: (t.submit_s, t.ready_s, t.admit_s, t.finish_s, t.completion_s) for t in result.traces}


# -- exact timelines ---------------------------------------------------------------------------
#
# One worker, continuous batching, every round 1 s whatever it holds, encode 0.1 s, decode 0.5 s
# on one decoder. A (3 steps) arrives at 0, B (2 steps) at 0.25. A round is decided whenever
# something happens (a request ready, a report, a decode done, a timer the core asked for); a
# busy worker with room in its pipeline takes its next plan only `pipeline_lead_s` before its
# current work is predicted to end (the profile's 1 s per plan, as the cost model says).

TWO = [request(0, 0.0, 3), request(1, 0.25, 2)]
# A steps alone once, then with B twice; both end at 3.1. The decoder takes A (first in the
# report) in [3.1, 3.6], then B in [3.6, 4.1].
A_DONE = (0.0, 0.1, 0.1, 3.1, 3.6)


def test_hand_timeline_pipeline_depth_1():
    # At 0.1 P1 (admit A, step A) runs [0.1, 1.1]. B, ready at 0.35, finds the one pipeline slot
    # taken. P1's report at 1.1 decides P2 (admit B; A and B step) [1.1, 2.1], whose report
    # decides P3 (A's 3rd step and B's 2nd: both finish) [2.1, 3.1].
    result = simulate(TWO, ConstantCost(), one_worker(1))
    got = timeline(result)
    assert got[0] == pytest.approx(A_DONE)
    assert got[1] == pytest.approx((0.25, 0.35, 1.1, 3.1, 4.1))
    assert result.busy_s == {"w0": pytest.approx(3.0)}
    assert result.rounds == 3


def test_hand_timeline_lead_0_decides_at_the_boundary():
    # Depth 2, but a busy worker opens only when its plan is predicted to end: P1, sent at 0.1,
    # ends at 1.1, so B's readiness at 0.35 finds the worker closed. At 1.1 the core's timer and
    # P1's report coincide, and the one decision after both sends P2 (admit B; A and B step); at
    # 2.1 likewise P3 (both finish). The simulator charges no round trip, so deciding at the
    # boundary loses nothing: this is depth 1's timeline.
    result = simulate(TWO, ConstantCost(), one_worker(2, lead=0.0))
    got = timeline(result)
    assert got[0] == pytest.approx(A_DONE)
    assert got[1] == pytest.approx((0.25, 0.35, 1.1, 3.1, 4.1))
    assert result.busy_s == {"w0": pytest.approx(3.0)}
    assert result.rounds == 3


def test_hand_timeline_default_lead_decides_just_before_the_boundary():
    # Lead 0.05: the worker opens 0.05 s before P1's predicted end (1.1), so the core's timer at
    # 1.05 sends P2 (admit B; A and B step) and B is admitted there; P2 starts at 1.1, when P1
    # ends. P1's report (1.0 s observed, as predicted) puts P2's end at 2.1: timer at 2.05, P3
    # (both finish) runs [2.1, 3.1]. Decisions: ready 0.1 and 0.35, timer 1.05, report 1.1,
    # timer 2.05, report 2.1, timer 3.05 (P3 alone in flight; nothing left to plan), report 3.1,
    # decoded 3.6 and 4.1.
    result = simulate(TWO, ConstantCost(), one_worker(2))
    got = timeline(result)
    assert got[0] == pytest.approx(A_DONE)
    assert got[1] == pytest.approx((0.25, 0.35, 1.05, 3.1, 4.1))
    assert result.busy_s == {"w0": pytest.approx(3.0)}
    assert result.rounds == 3
    assert result.decisions == 10


def test_hand_timeline_infinite_lead_pipelines_as_soon_as_there_is_room():
    # Lead inf: a worker with a free pipeline slot is always open, and a decision that sends it a
    # plan asks again at once. At 0.1 P1 (admit A, step A) and P2 (A's 2nd step) fill both slots,
    # so B, ready at 0.35, finds the worker full: it joins in P3 (A's 3rd step: A finishes; B's
    # 1st), sent at P1's report (1.1) and run [2.1, 3.1], and finishes alone in P4 [3.1, 4.1].
    # The price of pipelining a whole step ahead: a newcomer joins a step later than at lead 0.
    result = simulate(TWO, ConstantCost(), one_worker(2, lead=math.inf))
    got = timeline(result)
    assert got[0] == pytest.approx(A_DONE)
    assert got[1] == pytest.approx((0.25, 0.35, 1.1, 4.1, 4.6))
    assert result.busy_s == {"w0": pytest.approx(4.0)}
    assert result.rounds == 4


@pytest.mark.parametrize("host_cpus", [None, 2.0])
def test_hand_timeline_an_arrival_cuts_a_long_plan_short(host_cpus):
    # 1 s a round, plans up to 10 s. A (20 steps) steps once alone [0.1, 1.1] (the worker's step
    # time is unknown before), then 10 steps from 1.1. B is ready at 2.6, in A's second step of
    # that plan: the core interrupts it, the step ends at 3.1 and B joins there (not at 11.1).
    # A and B step twice to 5.1 (B ends), then A 10 steps and 5 more, to 20.1. On a shared host
    # of two cores nothing slows anything, so the cut job gives the same timeline.
    result = simulate([request(0, 0.0, 20), request(1, 2.5, 2)], ConstantCost(),
                      one_worker(1, max_plan_s=10.0, host_cpus=host_cpus))
    got = timeline(result)
    assert got[1] == pytest.approx((2.5, 2.6, 3.1, 5.1, 5.6))
    assert got[0] == pytest.approx((0.0, 0.1, 0.1, 20.1, 20.6))
    assert result.busy_s == {"w0": pytest.approx(20.0)} and result.rounds == 5
    # A policy that does not join running batches leaves the plan alone: B starts after A.
    result = simulate([request(0, 0.0, 20), request(1, 2.5, 2)], ConstantCost(),
                      replace(one_worker(1, max_plan_s=10.0, host_cpus=host_cpus), policy="static_fcfs"))
    assert timeline(result)[1][2] == pytest.approx(20.1)


def test_an_open_worker_is_asked_again_at_once():
    # A lone request under lead inf: P1 (sent at 0.1) leaves a free slot, so the same decision
    # asks again and sends P2 at 0.1 too; P3 follows P1's report at 1.1. Decisions (policy passes):
    # two at 0.1, reports 1.1 / 2.1 / 3.1, decoded 3.6.
    result = simulate([request(0, 0.0, 3)], ConstantCost(), one_worker(2, lead=math.inf))
    assert timeline(result)[0] == pytest.approx(A_DONE)
    assert result.rounds == 3
    assert result.decisions == 6


def test_hand_timeline_images_decoded_on_their_worker():
    # No decoder (`vae_decoder.on_workers`): depth 1's plans, but P3, which finishes both, also
    # decodes both on the worker (0.5 s each) [2.1, 4.1]; both are done when it reports.
    result = simulate(TWO, ConstantCost(), replace(one_worker(1), decoders=0))
    got = timeline(result)
    assert got[0] == pytest.approx((0.0, 0.1, 0.1, 4.1, 4.1))
    assert got[1] == pytest.approx((0.25, 0.35, 1.1, 4.1, 4.1))
    assert result.busy_s == {"w0": pytest.approx(4.0)} and result.decoder_busy_s == 0.0
    with pytest.raises(ValueError, match="decoders must be >= 0"):
        SimConfig(decoders=-1)


ON_WORKERS = TextEncoderSpec(replicas=0, cache_size=0)  # `text_encoder.on_workers`, no cache


def test_hand_timeline_prompts_encoded_on_their_worker():
    # No text encoder: a request is ready at its submit, and the plan that admits it encodes its
    # prompts first (0.1 s). P1 (admit A) [0, 1.1]; P2 (admit B) [1.1, 2.2]; P3 finishes and
    # decodes both on the worker [2.2, 4.2], as with `decoders=0` alone.
    result = simulate(TWO, ConstantCost(), replace(one_worker(1), decoders=0, text_encoder=ON_WORKERS))
    got = timeline(result)
    assert got[0] == pytest.approx((0.0, 0.0, 0.0, 4.2, 4.2))
    assert got[1] == pytest.approx((0.25, 0.25, 1.1, 4.2, 4.2))
    assert result.busy_s == {"w0": pytest.approx(4.2)} and result.text_encoder_busy_s == pytest.approx(0.2)
    # Depth 2, lead 0.05: the core predicts P1 with its encoding (1.1 s), so the worker opens for B
    # at 1.05, not at 0.95.
    result = simulate(TWO, ConstantCost(), replace(one_worker(2), decoders=0, text_encoder=ON_WORKERS))
    assert timeline(result)[1] == pytest.approx((0.25, 0.25, 1.05, 4.2, 4.2))


@pytest.mark.parametrize("host_cpus", [None, 2.0])
def test_a_cut_plan_that_encodes_ends_after_its_encoding_and_the_step_running(host_cpus):
    # As the arrival test above: A steps once [0, 1.1] (its encoding first), C's arrival cuts A's
    # 10-step plan at 3.1. P3 admits C: encoding [3.1, 3.2], then up to 10 steps. D, at 5.0, is
    # in P3's second step ([4.2, 5.2]), so P3 ends at 5.2 (not 5.1, as if it had not encoded).
    requests = [request(0, 0.0, 20), request(1, 2.5, 20), request(2, 5.0, 2)]
    config = replace(one_worker(1, max_plan_s=10.0, host_cpus=host_cpus), decoders=0, text_encoder=ON_WORKERS)
    got = timeline(simulate(requests, ConstantCost(), config))
    assert got[1][2] == pytest.approx(3.1)
    # D: encoding, 2 steps and its decode in the plan that admits it.
    assert got[2] == pytest.approx((5.0, 5.0, 5.2, 7.8, 7.8))


def test_a_worker_caches_the_prompts_it_encoded():
    same = [replace(request(0, 0.0, 1), prompt="x"), replace(request(1, 5.0, 1), prompt="x")]
    config = replace(one_worker(1), text_encoder=TextEncoderSpec(replicas=0, cache_size=4))
    result = simulate(same, ConstantCost(encode_s=0.1), config)
    # The second plan's prompt (and the empty negative prompt) are cached: it encodes nothing.
    assert result.text_encoder_busy_s == pytest.approx(0.1)
    assert [t.finish_s for t in result.traces] == pytest.approx([1.1, 6.0])
    with pytest.raises(ValueError, match="bad text encoder spec"):
        TextEncoderSpec(replicas=-1)


def test_request_overhead_is_split_around_the_router():
    # 0.2 s of fixed overhead: half before submit, half after decode; the rest shifts by 0.1.
    cost = ConstantCost(overhead_s=0.2)
    [trace] = simulate([request(0, 1.0, 2)], cost, one_worker(1)).traces
    assert (trace.submit_s, trace.ready_s, trace.admit_s) == pytest.approx((1.1, 1.2, 1.2))
    assert (trace.finish_s, trace.completion_s) == pytest.approx((3.2, 3.8))
    assert trace.latency_s == pytest.approx(2.8)
    assert trace.status == "finished"


def test_round_cost_counts_cfg_rows_and_groups():
    # Two shapes in one round are two forwards; each forward's cost depends on its rows.
    cost = BatchingCost(encode_s=0.0, decode_s=0.0, base_s=0.1, per_row_s=0.01, per_mpx_row_s=0.0)
    requests = [request(0, 0.0, 1, size=64), request(1, 0.0, 1, size=64, guidance=1.0), request(2, 0.0, 1, size=128)]
    result = simulate(requests, cost, replace(one_worker(1), text_encoder=TextEncoderSpec(batch_wait_s=0.0)))
    # All three are encoded in one batch and admitted together: one round with a 64 px group of
    # 3 rows (CFG + no CFG) and a 128 px group of 2 rows.
    assert result.busy_s["w0"] == pytest.approx((0.1 + 0.03) + (0.1 + 0.02))
    assert [t.finish_s for t in result.traces] == pytest.approx([0.25] * 3)


def test_text_encoder_batches_and_caches():
    # Two requests with the same prompt inside one 10 ms batch window: one encode call.
    spec = TextEncoderSpec(batch_wait_s=0.01)
    same = [replace(request(0, 0.0, 1), prompt="x"), replace(request(1, 0.004, 1), prompt="x")]
    result = simulate(same, ConstantCost(encode_s=0.1), replace(one_worker(1), text_encoder=spec))
    assert result.text_encoder_busy_s == pytest.approx(0.1)
    assert [t.ready_s for t in result.traces] == pytest.approx([0.11, 0.11])
    # Later, the cached prompt costs nothing: ready right after the batch window.
    late = same + [replace(request(2, 5.0, 1), prompt="x")]
    result = simulate(late, ConstantCost(encode_s=0.1), replace(one_worker(1), text_encoder=spec))
    assert result.traces[2].ready_s == pytest.approx(5.01)


def test_queue_full_rejects_like_the_router():
    requests = [request(i, 0.0, 5) for i in range(4)]
    result = simulate(requests, ConstantCost(encode_s=1.0), replace(one_worker(1), max_queued_images=2))
    assert Counter(t.status for t in result.traces) == {"finished": 2, "rejected": 2}
    records = result.records()
    assert sorted(r.status for r in records) == [200, 200, 429, 429]


# -- workloads at scale ------------------------------------------------------------------------

def mixed_workload(rate: float, n: int, seed: int = 0, sizes=(64,), steps=(10, 20, 40)) -> WorkloadSpec:
    return WorkloadSpec(
        arrival=PoissonArrivals(rate),
        classes=(RequestClass(name="mix", model=MODEL, sizes=tuple(SizeChoice(s, s) for s in sizes),
                              steps=StepsChoice(choices=steps), unique_prompts=True),),
        num_requests=n, slo_scale=5.0, seed=seed,
    )


def test_same_seed_same_records_other_seed_other_records():
    cost = BatchingCost()
    config = SimConfig(workers=3, max_batch_size=4)
    a = simulate(generate(mixed_workload(20, 300, seed=1), cost), cost, config)
    b = simulate(generate(mixed_workload(20, 300, seed=1), cost), cost, config)
    c = simulate(generate(mixed_workload(20, 300, seed=2), cost), cost, config)
    assert a.traces == b.traces and a.busy_s == b.busy_s and a.rounds == b.rounds
    assert a.traces != c.traces


@pytest.mark.parametrize("policy", ["continuous", "static_fcfs", "dynamic_batching"])
@pytest.mark.parametrize(("depth", "lead"), [(1, 0.05), (2, 0.05), (2, math.inf)])
def test_every_request_completes_exactly_once(policy, depth, lead):
    cost = BatchingCost()
    requests = generate(mixed_workload(8, 300, sizes=(64, 128)), cost)
    config = SimConfig(workers=4, max_batch_size=4, policy=policy, pipeline_depth=depth, pipeline_lead_s=lead,
                       max_queued_images=10_000)
    result = simulate(requests, cost, config)
    assert [t.index for t in result.traces] == list(range(300))
    assert all(t.status == "finished" for t in result.traces)
    for t in result.traces:
        assert t.arrival_s <= t.submit_s <= t.ready_s <= t.admit_s < t.finish_s < t.completion_s
        assert t.degrees == (1,) * t.steps  # every step planned once, on one worker
    # Work is conserved: busy time covers at least each request's steps at batch size 1 / cap.
    assert sum(result.busy_s.values()) > 0
    summary = result.summary()
    assert summary.ok == 300 and summary.failed == 0


def test_policies_plug_in_by_name_with_options():
    cost = ConstantCost()
    requests = [request(0, 0.0, 2), request(1, 0.1, 2)]
    # A 5 s window: the idle worker holds the first request until the window closes at 5.0 + its
    # encode (arrival 0, so the window closes at 5.0), then both go together.
    config = replace(one_worker(1), policy="dynamic_batching", policy_options={"window_s": 5.0})
    result = simulate(requests, cost, config)
    assert [t.admit_s for t in result.traces] == pytest.approx([5.0, 5.0])
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(requests, cost, replace(config, policy="no_such_policy"))
    with pytest.raises(ValueError, match="unknown option"):
        simulate(requests, cost, replace(config, policy_options={"window": 1}))


def test_continuous_beats_static_on_mean_latency_with_mixed_steps():
    cost = BatchingCost()
    requests = generate(mixed_workload(3, 400), cost)
    config = SimConfig(workers=2, max_batch_size=8, max_queued_images=10_000)
    continuous = simulate(requests, cost, replace(config, policy="continuous")).summary()
    static = simulate(requests, cost, replace(config, policy="static_fcfs")).summary()
    assert continuous.latency_mean_s < 0.8 * static.latency_mean_s
    assert continuous.slo_attainment >= static.slo_attainment


def test_scaling_smoke_16_workers_2000_requests():
    cost = BatchingCost()
    requests = generate(mixed_workload(30, 2000, sizes=(64, 128)), cost)
    # CPU time, not wall time: the machine is shared, and the question is how much work the
    # simulator does.
    result = simulate(requests, cost, SimConfig(workers=16, max_batch_size=8, decoders=16))
    assert all(t.status == "finished" for t in result.traces)  # the timing target is the slow test below


@pytest.mark.slow
def test_64_workers_10000_requests_under_a_minute():
    from stepserve.load_tests.workload import load_workload
    from stepserve.policies.cost_model import load_profile

    cost = load_profile("sd15-a100")
    spec = replace(load_workload("synerdiff-mixed"), num_requests=10_000).with_rate(16.0)
    requests = generate(spec, cost)
    started = time.process_time()
    result = simulate(requests, cost, SimConfig(workers=64, max_batch_size=8, decoders=64))
    cpu = time.process_time() - started
    assert all(t.status == "finished" for t in result.traces)
    assert cpu < 60, (f"64 workers x 10,000 requests took {cpu:.1f} s of CPU "
                      f"(inside RouterCore.schedule: {result.plan_wall_s:.1f} s wall)")


def test_a_policy_that_asks_to_wake_now_with_nothing_to_do_is_an_error():
    from stepserve.policies import register_policy

    @dataclass(frozen=True)
    class SpinConfig:
        pass

    @register_policy("test_spin_now", SpinConfig)
    class Spin:
        joins_running = True

        def __init__(self, config):
            self.config = config

        def plan(self, snapshot, worker_id):
            return Decision(wake_at=snapshot.now)

    with pytest.raises(ValueError, match="asked to be woken"):
        simulate([request(0, 0.0, 1)], ConstantCost(), replace(one_worker(1), policy="test_spin_now"))
