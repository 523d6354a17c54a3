"""Request-level static batching (the Diffusers-server baseline) on hand-made snapshots."""

from __future__ import annotations

import random

import pytest

from stepserve.policies import ClusterSnapshot, RequestView, ShapeKey, WorkerView, make_policy
from stepserve.policies.static_fcfs import StaticFCFS, StaticFCFSConfig

SMALL = ShapeKey("sd", 64, 64)
LARGE = ShapeKey("sd", 128, 128)


def req(rid, key=SMALL, arrival=0.0, ready=True, steps=10, done=0, worker=None):
    return RequestView(rid, key, True, done, steps, arrival, ready, worker)


def snap(workers, queued=()):
    """workers: {worker_id: (max_batch_size, [resident views])}."""
    running = []
    views = []
    for wid, (cap, residents) in workers.items():
        placed = [RequestView(**{**r.__dict__, "worker_id": wid}) for r in residents]
        running += placed
        views.append(WorkerView(wid, cap, tuple(r.request_id for r in placed)))
    return ClusterSnapshot(0.0, tuple(queued), tuple(running), tuple(views))


def test_registered_under_its_name():
    policy = make_policy("static_fcfs", {"max_batch_size": 2})
    assert isinstance(policy, StaticFCFS)
    assert policy.name == "static_fcfs"
    assert policy.config == StaticFCFSConfig(max_batch_size=2)


def test_running_batch_steps_and_admits_nothing():
    residents = [req("a", steps=20, done=3), req("b", steps=20, done=3)]
    queued = [req("q", arrival=5.0)]
    plan = StaticFCFS().plan(snap({"w0": (8, residents)}, queued), "w0")
    assert plan.admit == ()
    assert plan.groups == (("a", "b"),)


def test_idle_worker_forms_batch_of_same_shape_and_step_count():
    queued = [
        req("head", SMALL, arrival=1.0, steps=30),
        req("other_shape", LARGE, arrival=2.0, steps=30),
        req("other_steps", SMALL, arrival=3.0, steps=50),
        req("not_ready", SMALL, arrival=4.0, steps=30, ready=False),
        req("mate", SMALL, arrival=5.0, steps=30),
    ]
    plan = StaticFCFS().plan(snap({"w0": (8, [])}, queued), "w0")
    assert plan.admit == ("head", "mate")
    assert plan.groups == (("head", "mate"),)


def test_head_is_first_ready_request():
    queued = [req("waiting", ready=False), req("first", LARGE), req("second", LARGE)]
    plan = StaticFCFS().plan(snap({"w0": (8, [])}, queued), "w0")
    assert plan.admit == ("first", "second")


def test_batch_size_is_min_of_config_and_worker():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    assert len(StaticFCFS().plan(snap({"w0": (4, [])}, queued), "w0").admit) == 4
    capped = StaticFCFS(StaticFCFSConfig(max_batch_size=2))
    assert capped.plan(snap({"w0": (4, [])}, queued), "w0").admit == ("q0", "q1")


def test_empty_queue_gives_empty_plan():
    plan = StaticFCFS().plan(snap({"w0": (4, [])}, [req("x", ready=False)]), "w0")
    assert plan.is_empty


@pytest.mark.parametrize("seed", range(200))
def test_matches_oracle_on_random_snapshots(seed):
    rng = random.Random(seed)
    keys = [SMALL, LARGE]
    cap = rng.randint(1, 5)
    residents = [req(f"r{i}", rng.choice(keys)) for i in range(rng.choice([0, 0, rng.randint(1, cap)]))]
    queued = [
        req(f"q{i}", rng.choice(keys), arrival=float(i), ready=rng.random() < 0.7,
            steps=rng.choice([10, 20]))
        for i in range(rng.randint(0, 12))
    ]
    config_cap = rng.choice([None, 1, 3])
    plan = StaticFCFS(StaticFCFSConfig(config_cap)).plan(
        snap({"w0": (cap, residents), "w1": (cap, [])}, queued), "w0"
    )
    if residents:
        expected = []
    else:
        ready = [r for r in queued if r.ready]
        limit = cap if config_cap is None else min(cap, config_cap)
        expected = [
            r.request_id for r in ready
            if (r.shape_key, r.steps_total) == (ready[0].shape_key, ready[0].steps_total)
        ][:limit]
    assert list(plan.admit) == expected
    assert sorted(plan.stepping) == sorted([r.request_id for r in residents] + expected)


@pytest.mark.parametrize("bad", [0, False, 1.0])
def test_config_rejects_bad_cap(bad):
    with pytest.raises(ValueError, match="max_batch_size"):
        StaticFCFSConfig(max_batch_size=bad)
