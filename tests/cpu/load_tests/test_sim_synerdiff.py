"""SynerDiff in the simulator (`sim.synerdiff`): the derived contention model, a worker's decode
lane (chunks a round, alone when idle), skip-CFG past s_min, and whole runs that serve every
request, decode each image after its last step, and rank the variants as their mechanisms say."""

from __future__ import annotations

import dataclasses

import pytest

from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.sim.synerdiff import SynerDiffSim, WorkerSequencer
from stepserve.load_tests.sweep import load_cost
from stepserve.load_tests.workload import ScheduledRequest
from stepserve.policies.synerdiff.contention import Contention, concurrency_table
from stepserve.policies.synerdiff.types import Round
from stepserve.policies.types import RequestSpec

MODEL = "stable-diffusion-v1-5"
NAIVE = SynerDiffSim(chunking=False, skip_cfg=False, planner=False, controller=False)


@pytest.fixture(scope="module")
def cost():
    return load_cost("sd15-a100")


def test_contention_spikes_whole_decodes_and_chunks_soften_it():
    model = Contention(whole=0.8, floor=0.05)
    assert model.round(0.1, 0.1, 1) == pytest.approx((0.18, 0.18))  # InstGenIE's 45% drop
    assert model.round(0.1, 0.0, 4) == (0.1, 0.0) and model.round(0.0, 0.05, 1) == (0.05, 0.05)
    assert model.gamma(1) > model.gamma(2) > model.gamma(8) > model.floor
    with pytest.raises(ValueError):
        Contention(whole=0.01, floor=0.05)


def test_the_derived_table_covers_the_rounds_the_planner_may_pick():
    table = concurrency_table(lambda m, k: 0.02 * (2 * m - k) + 0.01, 0.12, 3, max_batch=4, max_vae=4)
    assert table.has(Round(4, 4, 4)) and table.has(Round(0, 3, 0)) and not table.has(Round(2, 3, 0))
    tau, delta = table.tau(Round(2, 1, 1)), table.delta(Round(2, 1, 1))
    assert 0 < delta <= tau and table.tau(Round(2, 0, 0)) > table.tau(Round(2, 0, 2))


class Member:  # what the sequencer reads of a resident request
    def __init__(self, rid: str, steps: int, done: int = 0):
        self.spec = RequestSpec(request_id=rid, model=MODEL, prompt="p", width=512, height=512,
                                num_inference_steps=steps, guidance_scale=7.5, seed=0)
        self.done = done


def test_a_decode_ends_after_its_chunks_and_alone_when_idle(cost):
    lane = WorkerSequencer(dataclasses.replace(NAIVE, chunking=True), cost, 8, lambda: 0)
    c = lane.chunk_levels(MODEL, 512, 512)[0]
    assert c > 1  # L(c) chunks on this profile
    lane.enqueue("a", Member("a", 20).spec)
    times, ended = lane.rounds([Member("x", 20)], c - 1)
    assert ended == [] and lane.decodes[0].left == 1
    times, ended = lane.rounds([Member("x", 20)], 2)
    assert [rid for rid, _ in ended] == ["a"] and 0 < ended[0][1] <= times[0] and not lane.decodes
    lane.enqueue("b", Member("b", 20).spec)
    lane.enqueue("c", Member("c", 20).spec)
    drained = lane.drain()
    assert [rid for rid, _ in drained] == ["b", "c"] and drained[0][1] < drained[1][1] and not lane.decodes


def test_skip_cfg_starts_at_s_min_of_the_quality(cost):
    lane = WorkerSequencer(dataclasses.replace(NAIVE, skip_cfg=True), cost, 8, lambda: 0)
    early, late = Member("e", 20, done=0), Member("l", 20, done=14)  # S = 0.95: from 70% of the steps
    lane.rounds([early, late], 1)
    assert (lane.steps, lane.skipped_steps) == (2, 1)
    plain = WorkerSequencer(NAIVE, cost, 8, lambda: 0)
    assert plain.rounds([early, late], 1)[0][0] > lane.rounds([early, late], 1)[0][0]


def burst(n: int, gap: float) -> list[ScheduledRequest]:
    return [ScheduledRequest(index=i, offset_s=i * gap, num_inference_steps=20 + 10 * (i % 3), seed=i, width=512,
                             height=512, guidance_scale=7.5, prompt=f"p{i}", model=MODEL) for i in range(n)]


@pytest.mark.parametrize("synerdiff", [NAIVE, SynerDiffSim(), dataclasses.replace(SynerDiffSim(), planner=False)])
def test_every_image_is_served_and_decoded_after_its_last_step(synerdiff, cost):
    result = simulate(burst(40, 0.2), cost, SimConfig(workers=1, decoders=0, synerdiff=synerdiff))
    assert all(t.status == "finished" for t in result.traces)
    assert all(t.finish_s < t.stored_s <= t.completion_s for t in result.traces)


def test_the_full_stack_outserves_naive_concurrency_under_a_burst(cost):
    requests = burst(80, 0.1)
    naive = simulate(requests, cost, SimConfig(workers=1, decoders=0, synerdiff=NAIVE)).summary()
    full = simulate(requests, cost, SimConfig(workers=1, decoders=0, synerdiff=SynerDiffSim())).summary()
    assert full.latency_mean_s < naive.latency_mean_s and full.span_s < naive.span_s


def test_synerdiff_decodes_on_the_workers():
    with pytest.raises(ValueError, match="decoders=0"):
        SimConfig(workers=1, decoders=1, synerdiff=SynerDiffSim())
