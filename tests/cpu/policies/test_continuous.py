"""Step-level continuous batching on hand-made snapshots, plus a closed-form oracle."""

from __future__ import annotations

import dataclasses
import random

import pytest

from stepserve.policies import Decision, PerWorker, Scheduler, ShapeKey, make_policy
from stepserve.policies.continuous import ContinuousBatching, ContinuousConfig

from tests.cpu.policies.snapshots import LARGE, SMALL, only_plan, plan_on, req, slot, snap, steps


def plan(snapshot, worker_id="w0", config=ContinuousConfig()):
    return only_plan(ContinuousBatching(config).plan(snapshot, worker_id), worker_id)


def test_registered_under_its_name():
    policy = make_policy("continuous")
    # A per-worker policy reaches the router as a Scheduler wrapping it.
    assert isinstance(policy, PerWorker) and isinstance(policy, Scheduler)
    assert isinstance(policy.policy, ContinuousBatching)
    assert policy.name == "continuous" and policy.policy.name == "continuous"


def test_idle_cluster_gives_no_plan():
    decision = ContinuousBatching().plan(snap({"w0": (4, [])}), "w0")
    assert decision == Decision()


def test_every_resident_steps_grouped_by_shape_oldest_group_first():
    residents = [
        req("a", SMALL, arrival=5.0),
        req("b", LARGE, arrival=1.0),
        req("c", SMALL, arrival=2.0),
        req("d", LARGE, arrival=9.0),
    ]
    decision = ContinuousBatching().plan(snap({"w0": (8, residents)}), "w0")
    assert decision.wake_at is None  # continuous batching never holds work back
    p = only_plan(decision, "w0")
    assert p.admit == ()
    # LARGE's oldest member arrived at 1.0, SMALL's at 2.0; members keep admission order.
    assert p.groups == steps(("b", "d"), ("a", "c"))
    assert p.drop == () and p.export == () and p.release == ()


def test_admits_ready_requests_fcfs_and_skips_unready_without_blocking():
    queued = [
        req("q1", arrival=1.0),
        req("q2", arrival=2.0, ready=False),
        req("q3", LARGE, arrival=3.0),
        req("q4", arrival=4.0),
    ]
    p = plan(snap({"w0": (8, [req("r", arrival=0.0)])}, queued))
    assert p.admit == ("q1", "q3", "q4")
    # Residents first, then admitted in FCFS order, within each shape group.
    assert p.groups == steps(("r", "q1", "q4"), ("q3",))


def test_new_request_joins_running_batch_at_step_boundary():
    resident = req("old", steps=50, done=30)
    p = plan(snap({"w0": (4, [resident])}, [req("new", arrival=9.0)]))
    assert p.admit == ("new",)
    assert p.groups == steps(("old", "new"))


def test_mixed_step_counts_share_a_group():
    queued = [req("a", steps=10), req("b", steps=50)]
    p = plan(snap({"w0": (4, [])}, queued))
    assert p.groups == steps(("a", "b"))


def test_worker_capacity_limits_admission():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(5)]
    p = plan(snap({"w0": (3, [req("r")])}, queued))
    assert p.admit == ("q0", "q1")


def test_full_worker_admits_nothing_but_still_steps():
    p = plan(snap({"w0": (1, [req("r")])}, [req("q")]))
    assert p.admit == ()
    assert p.groups == steps(("r",))


@pytest.mark.parametrize("config_cap, worker_cap, expected", [(2, 4, 2), (6, 3, 3), (None, 3, 3)])
def test_config_cap_is_min_with_worker_cap(config_cap, worker_cap, expected):
    queued = [req(f"q{i}", arrival=float(i)) for i in range(8)]
    p = plan(snap({"w0": (worker_cap, [])}, queued), config=ContinuousConfig(max_batch_size=config_cap))
    assert len(p.admit) == expected


def test_join_shortest_queue_first_asker_does_not_take_the_burst():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    p = plan(snap({"w0": (4, []), "w1": (4, [])}, queued))
    # load 0 <= peer's 0: admit one; load 1 > 0: stop.
    assert p.admit == ("q0",)


def test_join_shortest_queue_less_loaded_worker_catches_up():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    busy = [req("b1"), req("b2")]
    p = plan(snap({"w0": (4, []), "w1": (4, busy)}, queued))
    # Admits while its load (0, 1, 2) <= the peer's 2.
    assert p.admit == ("q0", "q1", "q2")


def test_join_shortest_queue_ignores_full_peers():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    full = [req("b1"), req("b2")]
    p = plan(snap({"w0": (4, []), "w1": (2, full)}, queued))
    assert p.admit == ("q0", "q1", "q2", "q3")


def test_join_shortest_queue_peer_room_uses_config_cap():
    # The peer's worker cap (8) leaves room, but the policy's own cap (2) does not.
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    peer = [req("b1"), req("b2")]
    p = plan(snap({"w0": (8, []), "w1": (8, peer)}, queued), config=ContinuousConfig(max_batch_size=2))
    assert p.admit == ("q0", "q1")


def _oracle_admit_count(snapshot, worker_id, cap):
    """Closed form of the admission rule, written independently of the policy's loop."""
    def limit(w):
        return w.max_batch_size if cap is None else min(cap, w.max_batch_size)

    me = snapshot.worker(worker_id)
    load = len(me.running)
    ready = sum(1 for r in snapshot.queued if r.ready)
    bound = min(limit(me) - load, ready)
    peers = [
        len(w.running)
        for w in snapshot.workers
        if w.worker_id != worker_id and len(w.running) < limit(w)
    ]
    if peers:
        bound = min(bound, min(peers) + 1 - load)
    return max(bound, 0)


@pytest.mark.parametrize("seed", range(300))
def test_matches_oracle_on_random_snapshots(seed):
    rng = random.Random(seed)
    keys = [SMALL, LARGE, ShapeKey("sdxl", 64, 64)]
    counter = iter(range(10_000))
    workers = {}
    for w in range(rng.randint(1, 4)):
        cap = rng.randint(1, 6)
        residents = [
            req(f"r{next(counter)}", rng.choice(keys), arrival=rng.uniform(0, 10))
            for _ in range(rng.randint(0, cap))
        ]
        workers[f"w{w}"] = (cap, residents)
    queued = [
        req(f"q{next(counter)}", rng.choice(keys), arrival=10 + i, ready=rng.random() < 0.7)
        for i in range(rng.randint(0, 10))
    ]
    snapshot = snap(workers, queued)
    worker_id = rng.choice(sorted(workers))
    config_cap = rng.choice([None, 1, 2, 3, 5])
    decision = ContinuousBatching(ContinuousConfig(config_cap)).plan(snapshot, worker_id)
    assert decision.wake_at is None
    p = only_plan(decision, worker_id)

    ready_ids = [r.request_id for r in queued if r.ready]
    n = _oracle_admit_count(snapshot, worker_id, config_cap)
    assert list(p.admit) == ready_ids[:n]  # an FCFS prefix of the ready requests

    members = list(snapshot.worker(worker_id).running) + list(p.admit)
    assert sorted(p.stepping) == sorted(members)  # everyone steps, exactly once
    by_id = {r.request_id: r for r in snapshot.running + snapshot.queued}
    assert all(g.ranks == () for g in p.groups)  # a worker's own batch, never an SP group
    group_keys = [by_id[g.request_ids[0]].shape_key for g in p.groups]
    assert len(set(group_keys)) == len(group_keys)  # one group per key
    for group in p.groups:
        ids = group.request_ids
        assert {by_id[rid].shape_key for rid in ids} == {by_id[ids[0]].shape_key}
        assert list(ids) == [rid for rid in members if rid in ids]  # admission order
    oldest = [min(by_id[rid].arrival_time for rid in g.request_ids) for g in p.groups]
    assert oldest == sorted(oldest)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4"])
def test_config_rejects_bad_cap(bad):
    with pytest.raises(ValueError, match="max_batch_size"):
        ContinuousConfig(max_batch_size=bad)


# ---- LoRA affinity ------------------------------------------------------------------------------


def styled(rid: str, *loras: str, arrival: float = 0.0):
    return dataclasses.replace(req(rid, arrival=arrival), loras=loras)


def test_a_lora_request_goes_to_the_worker_holding_its_loras():
    workers = {"w0": slot(4), "w1": slot(4, loras=frozenset({("sd", "x"), ("sd", "y")}))}
    queued = [styled("a", "x", "y"), req("b"), styled("c", "x", "z")]
    decision = make_policy("continuous").schedule(snap(workers, queued, now=0.1))
    # w0 is asked first (rank order among the idle): it leaves "a" to w1 and takes "b"; then it is
    # busier than w1, which takes "a" and "c" (whose "z" neither holds).
    assert plan_on(decision, "w0").admit == ("b",) and plan_on(decision, "w1").admit == ("a", "c")
    assert decision.wake_at == pytest.approx(0.2)  # when w0 may take "a" after all


def test_affinity_gives_way_to_load_room_and_time():
    holds = frozenset({("sd", "x")})
    # The holder is busier: the request goes where there is less load.
    busy_holder = {"w0": slot(4), "w1": slot(4, [req("r")], loras=holds)}
    assert plan_on(make_policy("continuous").schedule(snap(busy_holder, [styled("a", "x")])), "w0").admit == ("a",)
    # The holder is full.
    full = {"w0": slot(4, [req("p")]), "w1": slot(1, [req("r")], loras=holds)}
    assert plan_on(make_policy("continuous").schedule(snap(full, [styled("a", "x")])), "w0").admit == ("a",)
    # Its affinity is over.
    late = snap({"w0": slot(4), "w1": slot(4, loras=holds, open=False)}, [styled("a", "x")], now=1.0)
    assert plan_on(make_policy("continuous").schedule(late), "w0").admit == ("a",)
    # Off.
    off = snap({"w0": slot(4), "w1": slot(4, loras=holds)}, [styled("a", "x")])
    assert plan_on(make_policy("continuous", {"lora_affinity_s": 0.0}).schedule(off), "w0").admit == ("a",)
