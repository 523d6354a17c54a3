"""The composed policy on hand-made snapshots and through the router core: the spine decides as
GenServe does, the headroom keeps workers free for expected images (only against SP upgrades),
refusal gives up what cannot make its deadline, and a lone CFG image splits on an idle pool."""

from __future__ import annotations

import dataclasses
import math

import pytest

from stepserve.policies import make_policy
from stepserve.policies.composed import ComposedConfig, ComposedPolicy
from stepserve.policies.cost_model import load_profile
from stepserve.policies.genserve.policy import GenServePolicy
from stepserve.policies.types import GroupSplit, RequestKind, RequestStatus, ShapeKey
from tests.cpu.core_harness import Harness, spec
from tests.cpu.policies.genserve.fakes import FakeCosts
from tests.cpu.policies.snapshots import assert_executable, req, slot, snap, video

# FakeCosts: a 480x832, 81-frame video step is 4.0 s at degree 1, 2.05 s at 2; a 64 px CFG image
# step 0.0203 s (20 steps: 0.41 s).


def composed(**options) -> ComposedPolicy:
    return ComposedPolicy(ComposedConfig(**options), FakeCosts())


def video_workers(decision) -> set[str]:
    return {p.worker_id for p in decision.plans for g in p.groups if g.request_ids == ("v",)}


def images_every(period_s: float, until: float) -> list:
    return [req(f"i{k}", arrival=k * period_s, steps=20) for k in range(int(until / period_s))]


def test_it_is_registered_with_its_options_checked():
    policy = make_policy("composed", {"headroom_quantile": 0.5, "sp_degrees": [1, 2]}, FakeCosts())
    assert isinstance(policy, ComposedPolicy) and policy.config.sp_degrees == (1, 2)
    assert policy.splits_cfg and not make_policy("composed", {"cfg_parallel": False}, FakeCosts()).splits_cfg
    for bad in ({"headroom_quantile": 1.0}, {"headroom_window_s": 0}, {"cfg_min_gain": -0.1},
                {"refuse_unattainable": "yes"}, {"sp_degrees": (2, 1)}):
        with pytest.raises(ValueError):
            make_policy("composed", bad, FakeCosts())


def test_with_no_images_expected_it_decides_as_genserve():
    pool = {f"w{i}": slot(4) for i in range(4)}
    snapshot = snap(pool, [video("v", deadline=math.inf)])
    genserve = GenServePolicy(ComposedConfig().spine(), FakeCosts()).schedule(snapshot)
    mine = composed().schedule(snapshot)
    assert mine == genserve and len(video_workers(mine)) == 4  # every idle worker speeds the video up


def test_expected_images_keep_workers_free_of_sp_upgrades():
    """Images arrive every 0.5 s; a worker given to the video is held for a 4 s step: the 99%
    quantile of Poisson(8) images (15) caps at the pool: the video starts on one worker (starting
    a request outweighs a reserved worker) and the other three stay free."""
    history = images_every(0.5, 20.0)
    policy = composed()
    for k in range(len(history)):  # the policy sees each image arrive (and start at once)
        policy.schedule(snap({f"w{i}": slot(4) for i in range(4)}, [history[k]], now=history[k].arrival_time))
    snapshot = snap({f"w{i}": slot(4) for i in range(4)}, [video("v")], now=20.0)
    decision = policy.schedule(snapshot)
    assert_executable(snapshot, decision)
    assert policy.reserve == 4 and len(video_workers(decision)) == 1
    rate = ComposedPolicy(ComposedConfig(headroom_quantile=0.0), FakeCosts())
    assert len(video_workers(rate.schedule(snapshot))) == 4  # headroom off: GenServe's upgrade


def test_the_reserve_never_pauses_a_video_nor_holds_back_a_waiting_image():
    policy = composed(refuse_unattainable=False)  # serves the late image rather than refusing it
    history = images_every(0.5, 20.0)
    for image in history:
        policy.schedule(snap({"w0": slot(4), "w1": slot(4)}, [image], now=image.arrival_time))
    v = video("v", on=("w0",), deadline=math.inf)
    snapshot = snap({"w0": slot(4, [v]), "w1": slot(4)}, [req("late", arrival=19.0, deadline=19.5)], now=20.0)
    decision = policy.schedule(snapshot)
    assert policy.reserve >= 1
    by_worker = {p.worker_id: p for p in decision.plans}
    assert by_worker["w0"].groups[0].request_ids == ("v",) and not by_worker["w0"].export
    assert by_worker["w1"].admit == ("late",)  # a late image still beats an imagined one


def test_refusal_gives_up_only_what_cannot_make_its_deadline():
    snapshot = snap({"w0": slot(4), "w1": slot(4)},
                    [req("hopeless", steps=20, deadline=0.3), req("fine", steps=20, deadline=5.0),
                     req("free", steps=20)], now=0.0)
    kept = composed(refuse_unattainable=False).schedule(snapshot)
    assert not kept.discard  # off: everything is served, the late least-late first
    decision = composed().schedule(snapshot)
    assert [f.request_id for f in decision.discard] == ["hopeless"]
    assert "cannot meet its deadline" in decision.discard[0].message
    planned = {rid for p in decision.plans for rid in p.admit}
    assert planned == {"fine", "free"}


def test_refusal_prices_an_edit_of_a_cached_template_at_its_masked_share():
    # 20 steps of a 512 px CFG image: 0.82 s in full, 0.02 + 0.021 * 0.2 a step at share 0.2.
    edit = dataclasses.replace(req("edit", key=ShapeKey("sd", 512, 512), steps=20, deadline=0.6),
                               kind=RequestKind.EDIT, template_id="t", mask_ratio=0.2)
    snapshot = snap({"w0": slot(4)}, [edit], now=0.0)
    assert not composed().schedule(snapshot).discard
    unseen = dataclasses.replace(edit, template_id=None)  # no cached activations: it computes everything
    assert [f.request_id for f in composed().schedule(snap({"w0": slot(4)}, [unseen], now=0.0)).discard] == ["edit"]


SDXL = "stable-diffusion-xl-base-1.0"


def test_through_the_core_a_lone_cfg_image_splits_and_a_mixed_load_finishes():
    h = Harness("composed", {}, workers=2, batch=4, costs=load_profile("sdxl-h800"))
    h.submit(spec("a", steps=6, size=1024, model=SDXL))
    h.schedule()
    assert [g.split for p in h.sent[:2] for g in p.groups] == [GroupSplit.CFG, GroupSplit.CFG]
    h.run()
    assert h.core.state("a").degrees == (2,) * 6
    h.submit(*(spec(f"b{i}", steps=4, size=1024, model=SDXL) for i in range(5)))
    h.run()
    assert all(h.status(f"b{i}") is RequestStatus.FINISHED for i in range(5))


@pytest.mark.parametrize("refuse", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_runs_through_the_core_end_every_request(seed, refuse):
    """Images with tight SLOs, videos and cancellations on 1-4 workers: every plan passes the
    core's checks, no request is in two places, and every request ends finished, cancelled or
    (with refusal) refused; a finished one ran exactly its steps."""
    import random

    rng = random.Random(seed)
    costs = load_profile("tiny-sd-cpu", "tiny-wan-cpu")
    h = Harness("composed", {"refuse_unattainable": refuse, "sp_degrees": [1, 2]}, workers=rng.randint(1, 4),
                batch=rng.randint(1, 4), depth=rng.randint(1, 2), costs=costs)
    arrivals = []
    for i in range(rng.randint(8, 24)):
        video = rng.random() < 0.3
        arrivals.append((rng.randint(0, 30), spec(
            f"r{i:02d}", steps=rng.choice([2, 3, 5, 8]), size=rng.choice([32, 64]) if video else rng.choice([64, 128]),
            model="tiny-wan" if video else "tiny-sd", frames=rng.choice([5, 9]) if video else 1,
            guidance=rng.choice([1.0, 7.5]), slo_s=rng.choice([None, 0.05, 1.0, 30.0]))))
    cancels = {rng.randint(0, 40): a[1].request_id for a in rng.sample(arrivals, len(arrivals) // 5)}

    def check(snapshot):  # a request is on exactly the workers it lists (two for a split or SP group)
        views = {v.request_id: v for v in snapshot.running}
        for w in snapshot.workers:
            assert len(w.running) <= w.max_batch_size
            assert all(w.worker_id in views[rid].workers for rid in w.running)
        for view in views.values():
            assert all(view.request_id in snapshot.worker(w).running for w in view.workers)

    h.drive(arrivals, cancels, lambda worker_id: rng.random() < 0.7, check)
    for _, s in arrivals:
        state = h.core.state(s.request_id)
        allowed = (RequestStatus.FINISHED, RequestStatus.CANCELLED) + ((RequestStatus.FAILED,) if refuse else ())
        assert state.status in allowed, (s.request_id, state.status, state.error)
        if state.status is RequestStatus.FINISHED:
            assert state.steps_done == len(state.degrees) == s.num_inference_steps
        if state.status is RequestStatus.FAILED:
            assert "cannot meet its deadline" in state.error
    h.run()  # plans still queued (a split pair's release) run; then nothing is left anywhere
    assert all(not w.resident for w in h.workers.values())
