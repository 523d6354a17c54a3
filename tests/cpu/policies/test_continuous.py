"""Step-level continuous batching on hand-made snapshots, plus a closed-form oracle."""

from __future__ import annotations

import random

import pytest

from stepserve.policies import (
    ClusterSnapshot,
    RequestView,
    ShapeKey,
    WorkerPlan,
    WorkerView,
    make_policy,
)
from stepserve.policies.continuous import ContinuousBatching, ContinuousConfig

SMALL = ShapeKey("sd", 64, 64)
LARGE = ShapeKey("sd", 128, 128)


def req(rid, key=SMALL, arrival=0.0, ready=True, worker=None, steps=10, done=0):
    return RequestView(
        request_id=rid,
        shape_key=key,
        uses_cfg=True,
        steps_done=done,
        steps_total=steps,
        arrival_time=arrival,
        ready=ready,
        worker_id=worker,
    )


def snap(workers, queued=()):
    """workers: {worker_id: (max_batch_size, [resident views])}."""
    running = []
    views = []
    for wid, (cap, residents) in workers.items():
        placed = [
            RequestView(**{**r.__dict__, "worker_id": wid}) for r in residents
        ]
        running += placed
        views.append(WorkerView(wid, cap, tuple(r.request_id for r in placed)))
    return ClusterSnapshot(now=0.0, queued=tuple(queued), running=tuple(running), workers=tuple(views))


def test_registered_under_its_name():
    policy = make_policy("continuous")
    assert isinstance(policy, ContinuousBatching)
    assert policy.name == "continuous"


def test_idle_cluster_gives_empty_plan():
    plan = ContinuousBatching().plan(snap({"w0": (4, [])}), "w0")
    assert plan == WorkerPlan("w0")
    assert plan.is_empty


def test_every_resident_steps_grouped_by_shape_oldest_group_first():
    residents = [
        req("a", SMALL, arrival=5.0),
        req("b", LARGE, arrival=1.0),
        req("c", SMALL, arrival=2.0),
        req("d", LARGE, arrival=9.0),
    ]
    plan = ContinuousBatching().plan(snap({"w0": (8, residents)}), "w0")
    assert plan.admit == ()
    # LARGE's oldest member arrived at 1.0, SMALL's at 2.0; members keep admission order.
    assert plan.groups == (("b", "d"), ("a", "c"))
    assert plan.drop == ()


def test_admits_ready_requests_fcfs_and_skips_unready_without_blocking():
    queued = [
        req("q1", arrival=1.0),
        req("q2", arrival=2.0, ready=False),
        req("q3", LARGE, arrival=3.0),
        req("q4", arrival=4.0),
    ]
    plan = ContinuousBatching().plan(snap({"w0": (8, [req("r", arrival=0.0)])}, queued), "w0")
    assert plan.admit == ("q1", "q3", "q4")
    # Residents first, then admitted in FCFS order, within each shape group.
    assert plan.groups == (("r", "q1", "q4"), ("q3",))


def test_new_request_joins_running_batch_at_step_boundary():
    resident = req("old", steps=50, done=30)
    plan = ContinuousBatching().plan(snap({"w0": (4, [resident])}, [req("new", arrival=9.0)]), "w0")
    assert plan.admit == ("new",)
    assert plan.groups == (("old", "new"),)


def test_mixed_step_counts_share_a_group():
    queued = [req("a", steps=10), req("b", steps=50)]
    plan = ContinuousBatching().plan(snap({"w0": (4, [])}, queued), "w0")
    assert plan.groups == (("a", "b"),)


def test_worker_capacity_limits_admission():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(5)]
    plan = ContinuousBatching().plan(snap({"w0": (3, [req("r")])}, queued), "w0")
    assert plan.admit == ("q0", "q1")


def test_full_worker_admits_nothing_but_still_steps():
    plan = ContinuousBatching().plan(snap({"w0": (1, [req("r")])}, [req("q")]), "w0")
    assert plan.admit == ()
    assert plan.groups == (("r",),)


@pytest.mark.parametrize("config_cap, worker_cap, expected", [(2, 4, 2), (6, 3, 3), (None, 3, 3)])
def test_config_cap_is_min_with_worker_cap(config_cap, worker_cap, expected):
    queued = [req(f"q{i}", arrival=float(i)) for i in range(8)]
    policy = ContinuousBatching(ContinuousConfig(max_batch_size=config_cap))
    plan = policy.plan(snap({"w0": (worker_cap, [])}, queued), "w0")
    assert len(plan.admit) == expected


def test_join_shortest_queue_first_asker_does_not_take_the_burst():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    plan = ContinuousBatching().plan(snap({"w0": (4, []), "w1": (4, [])}, queued), "w0")
    # load 0 <= peer's 0: admit one; load 1 > 0: stop.
    assert plan.admit == ("q0",)


def test_join_shortest_queue_less_loaded_worker_catches_up():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    busy = [req("b1"), req("b2")]
    plan = ContinuousBatching().plan(snap({"w0": (4, []), "w1": (4, busy)}, queued), "w0")
    # Admits while its load (0, 1, 2) <= the peer's 2.
    assert plan.admit == ("q0", "q1", "q2")


def test_join_shortest_queue_ignores_full_peers():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    full = [req("b1"), req("b2")]
    plan = ContinuousBatching().plan(snap({"w0": (4, []), "w1": (2, full)}, queued), "w0")
    assert plan.admit == ("q0", "q1", "q2", "q3")


def test_join_shortest_queue_peer_room_uses_config_cap():
    # The peer's worker cap (8) leaves room, but the policy's own cap (2) does not.
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    peer = [req("b1"), req("b2")]
    policy = ContinuousBatching(ContinuousConfig(max_batch_size=2))
    plan = policy.plan(snap({"w0": (8, []), "w1": (8, peer)}, queued), "w0")
    assert plan.admit == ("q0", "q1")


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
    plan = ContinuousBatching(ContinuousConfig(config_cap)).plan(snapshot, worker_id)

    ready_ids = [r.request_id for r in queued if r.ready]
    n = _oracle_admit_count(snapshot, worker_id, config_cap)
    assert list(plan.admit) == ready_ids[:n]  # an FCFS prefix of the ready requests

    members = list(snapshot.worker(worker_id).running) + list(plan.admit)
    assert sorted(plan.stepping) == sorted(members)  # everyone steps, exactly once
    by_id = {r.request_id: r for r in snapshot.running + snapshot.queued}
    group_keys = [by_id[g[0]].shape_key for g in plan.groups]
    assert len(set(group_keys)) == len(group_keys)  # one group per key
    for group in plan.groups:
        assert {by_id[rid].shape_key for rid in group} == {by_id[group[0]].shape_key}
        assert list(group) == [rid for rid in members if rid in group]  # admission order
    oldest = [min(by_id[rid].arrival_time for rid in g) for g in plan.groups]
    assert oldest == sorted(oldest)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4"])
def test_config_rejects_bad_cap(bad):
    with pytest.raises(ValueError, match="max_batch_size"):
        ContinuousConfig(max_batch_size=bad)
