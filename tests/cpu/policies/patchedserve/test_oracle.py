"""Algorithm 1 against oracles written independently of it, over random small rounds.

Predicted finishes are replayed step by step (`stepped_finishes`) instead of from departure to
departure, slack is recomputed from the paper's formula, and each property is checked on the
batches the round leaves:

- everything admitted ends by its deadline, and no resident that did before misses after;
- a request discarded as hopeless could not make it even alone; one discarded for want of a
  worker misses on every open worker that still has room (more work never ends sooner);
- in urgent mode (threshold inf) on one worker, what is admitted or discarded for want of room
  is a prefix of the waiting requests in slack order, and nothing after it;
- in throughput mode (threshold -inf) with every worker open, nothing left waiting could join
  any worker with room on time without making someone miss.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from stepserve.policies.patchedserve import PatchedServeConfig, PatchedServePolicy
from stepserve.policies.patchedserve.mixed_costs import PackedForwardCosts
from stepserve.policies.patchedserve.schedulability import finish_times

from tests.cpu.policies.patchedserve.fakes import LinearCosts, stepped_finishes
from tests.cpu.policies.snapshots import LARGE, SMALL, assert_executable, plan_on, req, slot, snap


def random_request(rng: random.Random, rid: str, now: float):
    key = rng.choice((SMALL, LARGE))
    steps = rng.randint(1, 10)
    alone = steps * (0.02 if key == SMALL else 0.05)
    deadline = rng.choice((math.inf, now + alone * rng.uniform(0.5, 6.0)))
    return req(rid, key=key, steps=steps, deadline=deadline, arrival=rng.uniform(0.0, now),
               ready=rng.random() < 0.9)


def random_round(rng: random.Random, all_open: bool = False, workers: int | None = None):
    now = 1.0
    slots = {}
    for w in range(workers or rng.randint(1, 3)):
        cap = rng.randint(1, 4)
        residents = [replace(random_request(rng, f"w{w}r{i}", now), ready=True) for i in range(rng.randint(0, cap))]
        slots[f"w{w}"] = slot(cap, residents, open=all_open or rng.random() < 0.8, busy=rng.random() < 0.4)
    queued = [random_request(rng, f"q{i}", now) for i in range(rng.randint(0, 6))]
    return snap(slots, queued, now=now)


def check_round(snapshot, throughput_slack: float, mix: bool):
    policy = PatchedServePolicy(PatchedServeConfig(predictor="cost_model", throughput_slack=throughput_slack),
                                PackedForwardCosts(LinearCosts()) if mix else LinearCosts())
    decision = policy.schedule(snapshot)
    assert_executable(snapshot, decision)
    step = policy.latency.step_seconds
    now = snapshot.now
    waiting = {v.request_id: v for v in snapshot.queued}
    final = {}
    for worker in snapshot.open_workers():
        wid = worker.worker_id
        residents = list(snapshot.running_on(wid))
        batch = residents + [waiting[rid] for rid in plan_on(decision, wid).admit]
        start = now + step(residents) if worker.busy else now
        before, after = stepped_finishes(residents, start, step), stepped_finishes(batch, start, step)
        assert after == pytest.approx(finish_times(batch, start, step))
        for v in batch:
            if v in residents:
                assert before[v.request_id] > v.deadline or after[v.request_id] <= v.deadline, (wid, v)
            else:
                assert after[v.request_id] <= v.deadline, (wid, v)
        final[wid] = (worker, batch, start)
    for failure in decision.discard:
        v = waiting[failure.request_id]
        if "alone" in failure.message:
            assert now + v.steps_left * step([v]) > v.deadline
            continue
        assert "on any worker with room" in failure.message
        for worker, batch, start in final.values():
            if len(batch) < worker.max_batch_size:
                assert stepped_finishes([*batch, v], start, step)[v.request_id] > v.deadline
    return decision, policy, final


@pytest.mark.parametrize("seed", range(4))
def test_admissions_keep_everyone_on_time_and_discards_are_justified(seed):
    rng = random.Random(seed)
    for _ in range(150):
        check_round(random_round(rng), rng.choice((-math.inf, 0.5, 2.0, math.inf)), rng.random() < 0.5)


def test_urgent_mode_takes_waiting_requests_in_slack_order():
    rng = random.Random(7)
    for _ in range(300):
        snapshot = random_round(rng, all_open=True, workers=1)
        decision, policy, _ = check_round(snapshot, math.inf, rng.random() < 0.5)
        step = policy.latency.step_seconds
        now = snapshot.now
        hopeless = {f.request_id for f in decision.discard if "alone" in f.message}
        ready = [v for v in snapshot.queued if v.ready and v.request_id not in hopeless]
        # (DDL - C - P) / SA, with P and SA the steps left and all steps at the standalone pace.
        def slack(v):
            return ((v.deadline - v.arrival_time) - (now - v.arrival_time) - v.steps_left * step([v])) / (
                v.steps_total * step([v]))
        order = [v.request_id for v in sorted(ready, key=lambda v: (slack(v), v.arrival_time, v.request_id))]
        taken = set(plan_on(decision, "w0").admit) | ({f.request_id for f in decision.discard} - hopeless)
        assert set(order[:len(taken)]) == taken, (order, taken)


def test_throughput_mode_leaves_nothing_waiting_that_could_join():
    rng = random.Random(11)
    for _ in range(300):
        snapshot = random_round(rng, all_open=True)
        decision, policy, final = check_round(snapshot, -math.inf, rng.random() < 0.5)
        step = policy.latency.step_seconds
        placed = {rid for p in decision.plans for rid in p.admit} | {f.request_id for f in decision.discard}
        for v in snapshot.queued:
            if not v.ready or v.request_id in placed:
                continue
            for worker, batch, start in final.values():
                if len(batch) >= worker.max_batch_size:
                    continue
                before, after = stepped_finishes(batch, start, step), stepped_finishes([*batch, v], start, step)
                harms = any(before[m.request_id] <= m.deadline < after[m.request_id] for m in batch)
                assert harms or after[v.request_id] > v.deadline, (worker.worker_id, v)
