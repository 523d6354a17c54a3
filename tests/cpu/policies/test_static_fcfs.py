"""Request-level static batching (the Diffusers-server baseline) on hand-made snapshots."""

from __future__ import annotations

import random

import pytest

from stepserve.policies import Decision, PerWorker, make_policy
from stepserve.policies.static_fcfs import StaticFCFS, StaticFCFSConfig

from tests.cpu.policies.snapshots import LARGE, SMALL, only_plan, req, snap, steps


def plan(snapshot, worker_id="w0", config=StaticFCFSConfig()):
    decision = StaticFCFS(config).plan(snapshot, worker_id)
    assert decision.wake_at is None  # static batching starts as soon as it can, never waits on purpose
    return only_plan(decision, worker_id)


def test_registered_under_its_name():
    policy = make_policy("static_fcfs", {"max_batch_size": 2})
    assert isinstance(policy, PerWorker) and isinstance(policy.policy, StaticFCFS)
    assert policy.name == "static_fcfs"
    assert policy.policy.config == StaticFCFSConfig(max_batch_size=2)


def test_running_batch_steps_and_admits_nothing():
    residents = [req("a", steps=20, done=3), req("b", steps=20, done=3)]
    queued = [req("q", arrival=5.0)]
    p = plan(snap({"w0": (8, residents)}, queued))
    assert p.admit == ()
    assert p.groups == steps(("a", "b"))


def test_idle_worker_forms_batch_of_same_shape_and_step_count():
    queued = [
        req("head", SMALL, arrival=1.0, steps=30),
        req("other_shape", LARGE, arrival=2.0, steps=30),
        req("other_steps", SMALL, arrival=3.0, steps=50),
        req("not_ready", SMALL, arrival=4.0, steps=30, ready=False),
        req("mate", SMALL, arrival=5.0, steps=30),
    ]
    p = plan(snap({"w0": (8, [])}, queued))
    assert p.admit == ("head", "mate")
    assert p.groups == steps(("head", "mate"))


def test_head_is_first_ready_request():
    queued = [req("waiting", ready=False), req("first", LARGE), req("second", LARGE)]
    p = plan(snap({"w0": (8, [])}, queued))
    assert p.admit == ("first", "second")


def test_batch_size_is_min_of_config_and_worker():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    assert len(plan(snap({"w0": (4, [])}, queued)).admit) == 4
    capped = plan(snap({"w0": (4, [])}, queued), config=StaticFCFSConfig(max_batch_size=2))
    assert capped.admit == ("q0", "q1")


def test_nothing_ready_gives_no_plan():
    decision = StaticFCFS().plan(snap({"w0": (4, [])}, [req("x", ready=False)]), "w0")
    assert decision == Decision()


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
    p = plan(snap({"w0": (cap, residents), "w1": (cap, [])}, queued), config=StaticFCFSConfig(config_cap))
    if residents:
        expected = []
    else:
        ready = [r for r in queued if r.ready]
        limit = cap if config_cap is None else min(cap, config_cap)
        expected = [
            r.request_id for r in ready
            if (r.shape_key, r.steps_total) == (ready[0].shape_key, ready[0].steps_total)
        ][:limit]
    assert list(p.admit) == expected
    assert sorted(p.stepping) == sorted([r.request_id for r in residents] + expected)
    if not residents and expected:
        # A fresh batch is one pipeline call: one group, FCFS.
        assert p.groups == steps(expected)


@pytest.mark.parametrize("bad", [0, False, 1.0])
def test_config_rejects_bad_cap(bad):
    with pytest.raises(ValueError, match="max_batch_size"):
        StaticFCFSConfig(max_batch_size=bad)
