"""GenServe as a Scheduler: `round_input` (snapshot -> solver input), `plans_for` (solver decision
-> per-worker plans) and `GenServePolicy.schedule`, on hand-made snapshots.

FakeCosts numbers used below. Images: IMG (512x512) with CFG steps in 0.041 s alone (20 steps
= 0.82 s). Videos (CLIP: 480x832, 81 frames, 40 steps): 4.0 / 2.05 / 1.15 s per step at degree
1/2/4, so 160 / 82 / 46 s to finish. Default round: 1 s.

Every decision is checked against the plan rules of stepserve/routing/plan_check.py (`assert_executable`,
written against the snapshot: the real checker reads a router core's private state, which a
hand-made snapshot does not have), and against the rule that a busy worker only continues.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.genserve import GenServeConfig, ImageRequest, VideoAction, VideoJob, VideoStatus
from stepserve.policies.genserve.costs import MemoizedCosts
from stepserve.policies.genserve.policy import GenServePolicy, plans_for, round_input
from stepserve.policies.types import ClusterSnapshot, Decision, RequestKind, ShapeKey, StepGroup, WorkerPlan

from tests.cpu.policies.snapshots import CLIP, assert_executable, plan_on, req, slot, snap, steps, video
from tests.cpu.policies.genserve.fakes import FakeCosts

IMG = ShapeKey("sd", 512, 512)
BIG = ShapeKey("sd", 1024, 1024)
ELASTIC_OFF = GenServeConfig(elastic_sp=False)
URGENT_S = 1.5  # an IMG image of 20 steps is on time only if it starts now (waiting a round: 1.82 s)


def img(rid, deadline=math.inf, key=IMG, arrival=0.0, **kw):
    return req(rid, key, arrival=arrival, steps=kw.pop("steps", 20), deadline=deadline, **kw)


def schedule(snapshot: ClusterSnapshot, config: GenServeConfig = GenServeConfig(), costs=None):
    policy = GenServePolicy(config, costs or FakeCosts())
    decision = policy.schedule(snapshot)
    assert_continuations_only(snapshot, decision)
    assert_executable(snapshot, decision)
    return policy, decision


def assert_continuations_only(snapshot: ClusterSnapshot, decision: Decision) -> None:
    """A busy worker's plan is pipelined behind work whose outcome is not known yet, so it may
    only continue what it holds: no admits, exports or releases, and it steps only residents."""
    for plan in decision.plans:
        worker = snapshot.worker(plan.worker_id)
        if worker.busy:
            assert not (plan.admit or plan.export or plan.release), plan
            assert set(plan.stepping) <= set(worker.running), plan


def sp_step(rid, *ranks):
    return (StepGroup((rid,), tuple(ranks)),)


# -- round_input --------------------------------------------------------------------------------


def test_round_input_is_the_solvers_view_of_the_snapshot():
    running_video = video("v", deadline=90.0, on=("w0", "w1"), done=10, arrival=1.0)
    snapshot = snap(
        {"w0": slot(4, [running_video]), "w1": slot(4, [running_video], busy=True),
         "w2": slot(4, [img("home", deadline=9.0, done=5, rows=1)]),
         "w3": slot(4, [img("stranded", deadline=8.0)], busy=True, decoding=True)},
        [img("queued", deadline=7.0, arrival=2.0), img("encoding", ready=False),
         video("paused", paused=True, done=3, arrival=0.5), video("fresh", steps=30, arrival=3.0),
         video("unready", ready=False)],
        now=4.0)
    inp = round_input(snapshot)
    assert inp.now == 4.0
    # The decoding worker is out of the round; busy is the busy ones left in it.
    assert inp.workers == ("w0", "w1", "w2") and inp.busy == frozenset({"w1"})
    # Unready requests cannot run, so the solver never sees them; the decoding worker's image is
    # homeless to it (it cannot step there).
    assert {i.request_id: i for i in inp.images} == {
        "queued": ImageRequest("queued", IMG, 2, 20, 7.0, 2.0, None),
        "home": ImageRequest("home", IMG, 1, 15, 9.0, 0.0, "w2"),
        "stranded": ImageRequest("stranded", IMG, 2, 20, 8.0, 0.0, None),
    }
    assert {v.job_id: v for v in inp.videos} == {
        "v": VideoJob("v", "wan", 480, 832, 81, 30, 90.0, 1.0, VideoStatus.RUNNING, ("w0", "w1")),
        "paused": VideoJob("paused", "wan", 480, 832, 81, 37, math.inf, 0.5, VideoStatus.PAUSED),
        "fresh": VideoJob("fresh", "wan", 480, 832, 81, 30, math.inf, 3.0, VideoStatus.QUEUED),
    }


def test_nothing_ready_or_no_worker_in_the_round_is_an_empty_decision():
    policy, decision = schedule(snap({"w0": slot(4)}, [img("encoding", ready=False)]))
    assert decision == Decision() and policy.decisions == 0
    # Every worker decoding: there is nobody to plan for.
    policy, decision = schedule(snap({"w0": slot(4, busy=True, decoding=True)}, [video("v")]))
    assert decision == Decision() and policy.decisions == 0


# -- videos ---------------------------------------------------------------------------------


def test_running_videos_keep_their_groups_with_one_sp_step_on_every_member():
    u = video("u", deadline=500.0, on=("w0", "w1"))
    v = video("v", deadline=500.0, on=("w3", "w2"))  # listed out of rank order: ranks are sorted
    snapshot = snap({"w0": slot(4, [u]), "w1": slot(4, [u]), "w2": slot(4, [v]), "w3": slot(4, [v])})
    policy, decision = schedule(snapshot)
    assert [vd.action for vd in policy.last_decision.videos] == [VideoAction.KEEP, VideoAction.KEEP]
    assert {p.worker_id: p for p in decision.plans} == {
        "w0": WorkerPlan("w0", groups=sp_step("u", 0, 1)), "w1": WorkerPlan("w1", groups=sp_step("u", 0, 1)),
        "w2": WorkerPlan("w2", groups=sp_step("v", 2, 3)), "w3": WorkerPlan("w3", groups=sp_step("v", 2, 3)),
    }


def test_a_kept_video_on_one_worker_steps_without_ranks():
    v = video("v", deadline=500.0, on=("w0",))
    policy, decision = schedule(snap({"w0": slot(4, [v])}))
    assert decision.plans == (WorkerPlan("w0", groups=steps(("v",))),)


def test_a_kept_video_steps_on_a_busy_member_but_waits_for_a_closed_one():
    v = video("v", deadline=500.0, on=("w0", "w1"))
    # Busy but open: its next step is a continuation, pipelined behind the current one.
    _, decision = schedule(snap({"w0": slot(4, [v], busy=True), "w1": slot(4, [v])}))
    assert {p.worker_id: p.groups for p in decision.plans} == {"w0": sp_step("v", 0, 1), "w1": sp_step("v", 0, 1)}
    # A closed member cannot take the step, and an SP step needs every member: nobody steps.
    policy, decision = schedule(snap({"w0": slot(4, [v], open=False), "w1": slot(4, [v])}))
    assert policy.last_decision.video("v").action is VideoAction.KEEP
    assert decision == Decision()


def test_a_paused_video_is_exported_by_its_first_member_and_released_by_the_others():
    v = video("v", deadline=500.0, on=("w0", "w1"))
    snapshot = snap({"w0": slot(4, [v]), "w1": slot(4, [v])}, [img("urgent", deadline=URGENT_S)])
    policy, decision = schedule(snapshot, ELASTIC_OFF)
    assert policy.last_decision.video("v").action is VideoAction.PAUSE
    assert policy.last_decision.batch_on("w0").request_ids == ("urgent",)
    # The image takes the worker the video leaves, in the same round.
    assert plan_on(decision, "w0") == WorkerPlan("w0", admit=("urgent",), groups=steps(("urgent",)), export=("v",))
    assert plan_on(decision, "w1") == WorkerPlan("w1", release=("v",))
    assert len(decision.plans) == 2


@pytest.mark.parametrize("flags", [{"busy": True}, {"open": False}], ids=["busy", "closed"])
@pytest.mark.parametrize("member", ["w0", "w1"])
def test_a_pause_waits_until_every_member_is_free(flags, member):
    v = video("v", deadline=500.0, on=("w0", "w1"))
    workers = {"w0": slot(4, [v]), "w1": slot(4, [v])}
    workers[member] = slot(4, [v], **flags)
    policy, decision = schedule(snap(workers, [img("urgent", deadline=URGENT_S)]), ELASTIC_OFF)
    assert policy.last_decision.video("v").action is VideoAction.PAUSE
    # Half a pause would split the group's state; the image cannot join a worker the video
    # still holds. The next round decides again on the state at the boundary.
    assert decision == Decision()


def test_a_move_is_exported_first_and_the_next_round_resumes_it_on_its_new_group():
    # Alone on w0 with w1 idle: elastic SP grows it to both workers.
    v = video("v", deadline=500.0, on=("w0",), done=5)
    policy, decision = schedule(snap({"w0": slot(4, [v]), "w1": slot(4)}))
    vd = policy.last_decision.video("v")
    assert vd.action is VideoAction.RUN and vd.workers == ("w0", "w1")
    # No step this round: every member of the new group must import the same host state.
    assert decision.plans == (WorkerPlan("w0", export=("v",)),)
    # The router pauses it to host memory; the next round resumes it on the new group.
    paused = video("v", deadline=500.0, paused=True, done=5)
    _, decision = schedule(snap({"w0": slot(4), "w1": slot(4)}, [paused]))
    assert {p.worker_id: p for p in decision.plans} == {
        "w0": WorkerPlan("w0", admit=("v",), groups=sp_step("v", 0, 1)),
        "w1": WorkerPlan("w1", admit=("v",), groups=sp_step("v", 0, 1)),
    }


def test_a_shrinking_video_leaves_its_group_and_the_freed_worker_takes_the_image():
    v = video("v", deadline=500.0, on=("w0", "w1"))
    policy, decision = schedule(snap({"w0": slot(4, [v]), "w1": slot(4, [v])}, [img("urgent", deadline=URGENT_S)]))
    vd = policy.last_decision.video("v")
    assert vd.action is VideoAction.RUN and vd.workers == ("w0",)
    assert policy.last_decision.batch_on("w1").request_ids == ("urgent",)
    assert {p.worker_id: p for p in decision.plans} == {
        "w0": WorkerPlan("w0", export=("v",)),
        "w1": WorkerPlan("w1", admit=("urgent",), groups=steps(("urgent",)), release=("v",)),
    }


@pytest.mark.parametrize("flags", [{"busy": True}, {"open": False}], ids=["busy", "closed"])
def test_a_move_waits_until_every_member_is_free(flags):
    v = video("v", deadline=500.0, on=("w0", "w1"))
    snapshot = snap({"w0": slot(4, [v], **flags), "w1": slot(4, [v])}, [img("urgent", deadline=URGENT_S)])
    policy, decision = schedule(snapshot)
    assert policy.last_decision.video("v").action is VideoAction.RUN
    assert decision == Decision()


def test_a_queued_video_starts_on_a_free_group():
    policy, decision = schedule(snap({"w0": slot(4), "w1": slot(4)}, [video("v", deadline=100.0)]))
    assert policy.last_decision.video("v").workers == ("w0", "w1")
    assert {p.worker_id: p for p in decision.plans} == {
        "w0": WorkerPlan("w0", admit=("v",), groups=sp_step("v", 0, 1)),
        "w1": WorkerPlan("w1", admit=("v",), groups=sp_step("v", 0, 1)),
    }


def test_a_worker_given_to_a_video_sheds_its_idle_images():
    # 82.5 s: met only at degree 2 from now (82 s); a round's wait (83 s) or degree 1 (160 s)
    # misses it, while the images have no SLO and lose nothing by waiting.
    residents = [img("i1"), img("i2")]
    snapshot = snap({"w0": slot(4), "w1": slot(4, residents)}, [video("v", deadline=82.5)])
    policy, decision = schedule(snapshot)
    assert policy.last_decision.video("v").workers == ("w0", "w1")
    assert policy.last_decision.image_batches == ()
    assert plan_on(decision, "w0") == WorkerPlan("w0", admit=("v",), groups=sp_step("v", 0, 1))
    assert plan_on(decision, "w1") == WorkerPlan("w1", admit=("v",), groups=sp_step("v", 0, 1), export=("i1", "i2"))


@pytest.mark.parametrize("flags", [{"busy": True}, {"open": False}], ids=["busy", "closed"])
def test_a_video_starts_only_when_every_member_is_free(flags):
    snapshot = snap({"w0": slot(4), "w1": slot(4, **flags)}, [video("v", deadline=82.5)])
    policy, decision = schedule(snapshot)
    assert policy.last_decision.video("v").workers == ("w0", "w1")
    assert decision == Decision()


def test_a_video_does_not_start_on_a_worker_another_video_still_holds():
    # `held` shrinks to w0 and `v` gets w1 + w2, both free; but w0 is busy, so held's move (and
    # with it w1) waits, and v must not join w1 beside a video that is still there.
    held = video("held", deadline=5000.0, on=("w0", "w1"))
    snapshot = snap({"w0": slot(4, [held], busy=True), "w1": slot(4, [held]), "w2": slot(4)},
                    [video("v", deadline=82.5)])
    policy, decision = schedule(snapshot)
    assert policy.last_decision.video("held").workers == ("w0",)
    assert policy.last_decision.video("v").workers == ("w1", "w2")
    assert decision == Decision()


def test_a_video_starts_where_another_leaves_in_the_same_round():
    # With w0 free, `held` is paused for the tight `v`: w0 exports it and admits v at once.
    held = video("held", deadline=500.0, on=("w0",))
    policy, decision = schedule(snap({"w0": slot(4, [held]), "w1": slot(4)}, [video("v", deadline=82.5)]))
    assert policy.last_decision.video("held").action is VideoAction.PAUSE
    assert {p.worker_id: p for p in decision.plans} == {
        "w0": WorkerPlan("w0", admit=("v",), groups=sp_step("v", 0, 1), export=("held",)),
        "w1": WorkerPlan("w1", admit=("v",), groups=sp_step("v", 0, 1)),
    }


# -- images -----------------------------------------------------------------------------------


def three_images(**flags):
    """a resident on w0, b queued, c resident on w1; one batch (EDF: a, b, c) that lands on w0."""
    return snap({"w0": slot(4, [img("a", deadline=30.0)], **flags.get("w0", {})),
                 "w1": slot(4, [img("c", deadline=32.0)], **flags.get("w1", {}))},
                [img("b", deadline=31.0)])


def test_an_image_batch_admits_waiting_steps_resident_and_exports_members_held_elsewhere():
    policy, decision = schedule(three_images())
    batch = policy.last_decision.batch_on("w0")
    assert batch.request_ids == ("a", "b", "c") and batch.admit == ("b", "c")
    # c moves: exported from w1 now, admitted on w0 in a later round (from host memory).
    assert {p.worker_id: p for p in decision.plans} == {
        "w0": WorkerPlan("w0", admit=("b",), groups=steps(("a", "b"))),
        "w1": WorkerPlan("w1", export=("c",)),
    }


def test_a_busy_worker_steps_its_resident_images_and_admits_nothing():
    _, decision = schedule(three_images(w0={"busy": True}))
    # Neither b's admission nor c's move happens until w0 is at its boundary.
    assert decision.plans == (WorkerPlan("w0", groups=steps(("a",))),)


def test_an_image_on_a_busy_worker_is_not_moved():
    _, decision = schedule(three_images(w1={"busy": True}))
    assert decision.plans == (WorkerPlan("w0", admit=("b",), groups=steps(("a", "b"))),)


def test_a_full_worker_exports_its_idle_images_newest_first():
    residents = [img("r1", key=BIG, arrival=0.0), img("r2", key=BIG, arrival=0.1), img("r3", key=BIG, arrival=0.2)]
    queued = [img("q1", deadline=URGENT_S, arrival=0.3), img("q2", deadline=URGENT_S + 0.1, arrival=0.4)]
    policy, decision = schedule(snap({"w0": slot(3, residents)}, queued))
    assert policy.last_decision.batch_on("w0").request_ids == ("q1", "q2")
    # Two places are needed: the two admitted last go to host memory, the oldest stays.
    assert decision.plans == (WorkerPlan("w0", admit=("q1", "q2"), groups=steps(("q1", "q2")), export=("r2", "r3")),)


def test_a_full_worker_admits_fewer_when_its_residents_all_step():
    snapshot = snap({"w0": slot(2, [img("r1", deadline=30.0)])}, [img("q1", deadline=31.0), img("q2", deadline=32.0)])
    policy, decision = schedule(snapshot)
    assert policy.last_decision.batch_on("w0").request_ids == ("r1", "q1", "q2")
    # One place left: the first waiting member (EDF) joins; q2 waits for a later round.
    assert decision.plans == (WorkerPlan("w0", admit=("q1",), groups=steps(("r1", "q1"))),)


# -- workers outside the round, SP availability, measured overheads ------------------------------


def test_a_decoding_worker_is_left_out_of_the_round():
    snapshot = snap({"w0": slot(4), "w1": slot(4, busy=True, decoding=True)}, [video("v", deadline=500.0)])
    policy, decision = schedule(snapshot)
    # Without w1 the video starts alone on w0 (with it, it would take both: see the next check).
    assert policy.last_decision.video("v").workers == ("w0",)
    assert decision.plans == (WorkerPlan("w0", admit=("v",), groups=steps(("v",))),)
    _, both = schedule(snap({"w0": slot(4), "w1": slot(4)}, [video("v", deadline=500.0)]))
    assert {p.worker_id for p in both.plans} == {"w0", "w1"}


def test_an_image_on_a_decoding_worker_stays_there():
    snapshot = snap({"w0": slot(4), "w1": slot(4, [img("c", deadline=30.0)], busy=True, decoding=True)},
                    [img("b", deadline=31.0)])
    _, decision = schedule(snapshot)
    assert decision.plans == (WorkerPlan("w0", admit=("b",), groups=steps(("b",))),)


def test_without_sp_a_video_starts_at_degree_one():
    queued = [video("v", deadline=100.0)]
    policy, decision = schedule(snap({"w0": slot(4), "w1": slot(4)}, queued, sp_available=False))
    assert policy.last_decision.video("v").workers == ("w0",)
    assert decision.plans == (WorkerPlan("w0", admit=("v",), groups=steps(("v",))),)
    # The restriction is per round: the policy's own config is untouched.
    assert policy.config == GenServeConfig()
    policy.schedule(snap({"w0": slot(4), "w1": slot(4)}, queued))
    assert policy.last_decision.video("v").workers == ("w0", "w1")


@pytest.mark.parametrize("config", [GenServeConfig(), ELASTIC_OFF, GenServeConfig(preemption=False)],
                         ids=["elastic", "fixed", "no-preemption"])
def test_without_sp_a_running_sp_video_is_not_stepped_as_an_sp_group(config):
    # The workers' world went down (a worker elsewhere died) while v ran on w0+w1: it leaves
    # its group for host memory (export on the first member, release on the other).
    v = video("v", deadline=500.0, on=("w0", "w1"))
    snapshot = snap({"w0": slot(4, [v]), "w1": slot(4, [v]), "w2": slot(4)}, sp_available=False)
    _, decision = schedule(snapshot, config)
    assert all(not g.ranks for p in decision.plans for g in p.groups)
    assert plan_on(decision, "w0").export == ("v",) and plan_on(decision, "w1").release == ("v",)


def test_measured_overheads_change_the_costs_and_identical_ones_reuse_the_memo():
    costs = FakeCosts()
    policy = GenServePolicy(GenServeConfig(), costs)
    workers = {"w0": slot(4)}
    queued = [img("q", deadline=30.0)]
    shape = BatchShape(IMG.model, IMG.height, IMG.width, 2)  # q alone: one CFG image
    base_step = costs.step_seconds(shape)
    costs.calls = 0

    policy.schedule(snap(workers, queued))
    first = policy.costs
    assert isinstance(first, MemoizedCosts)
    assert policy.last_decision.image_batches[0].step_s == pytest.approx(base_step)
    calls = costs.calls
    assert calls > 0

    # An equal tuple (not the same object): the memo stays, so the profile is not asked again.
    policy.schedule(snap(workers, queued, step_overhead_s=()))
    assert policy.costs is first and costs.calls == calls

    measured = ((RequestKind.T2I, 0.5),)
    policy.schedule(snap(workers, queued, step_overhead_s=measured))
    second = policy.costs
    assert second is not first
    assert policy.last_decision.image_batches[0].step_s == pytest.approx(base_step + 0.5)
    calls = costs.calls
    policy.schedule(snap(workers, queued, step_overhead_s=((RequestKind.T2I, 0.5),)))
    assert policy.costs is second and costs.calls == calls

    # A video overhead leaves image steps at the profile, and a video's step pays it.
    policy.schedule(snap(workers, queued, step_overhead_s=((RequestKind.T2V, 2.0),)))
    assert policy.costs is not second
    assert policy.last_decision.image_batches[0].step_s == pytest.approx(base_step)
    clip = dataclasses.replace(shape, height=CLIP.height, width=CLIP.width, frames=CLIP.frames, rows=2)
    assert policy.costs.step_seconds(clip) == pytest.approx(costs.step_seconds(clip) + 2.0)

    # Back to none: the plain profile again.
    policy.schedule(snap(workers, queued))
    assert policy.last_decision.image_batches[0].step_s == pytest.approx(base_step)
    assert policy.decisions == 6


# -- plans_for on the solver's own decision ------------------------------------------------------


def test_plans_for_turns_the_last_decision_into_the_same_plans():
    v = video("v", deadline=500.0, on=("w0", "w1"))
    snapshot = snap({"w0": slot(4, [v]), "w1": slot(4, [v]), "w2": slot(4, [img("a", deadline=30.0)])},
                    [img("b", deadline=31.0), video("q", deadline=400.0)])
    policy, decision = schedule(snapshot)
    assert plans_for(policy.last_decision, snapshot) == decision.plans


# -- random rounds --------------------------------------------------------------------------


CONFIGS = [GenServeConfig(), GenServeConfig(sp_degrees=(1, 2, 4)), ELASTIC_OFF, GenServeConfig(dp=False),
           GenServeConfig(preemption=False), GenServeConfig(image_max_batch=2, round_s=0.2)]


def random_snapshot(rng: random.Random) -> ClusterSnapshot:
    n = rng.randint(1, 6)
    ids = [f"w{i}" for i in range(n)]
    flags = {}
    for w in ids:
        busy = rng.random() < 0.3
        flags[w] = {"open": rng.random() < 0.85, "busy": busy, "decoding": busy and rng.random() < 0.3}
    residents: dict[str, list] = {w: [] for w in ids}
    free = [w for w in ids if not flags[w]["decoding"]]  # a decoding worker holds no running video
    queued = []
    counter = iter(range(10_000))
    now = 10.0
    for _ in range(rng.randint(0, 3)):
        steps_total = rng.randint(5, 40)
        done = rng.randint(0, steps_total - 1)
        deadline = rng.choice([math.inf, now + rng.uniform(-5.0, 200.0)])
        key = rng.choice([CLIP, ShapeKey("wan", 240, 416, 17)])
        rid = f"v{next(counter)}"
        degrees = [d for d in (1, 2, 4) if d <= len(free)]
        if degrees and rng.random() < 0.5:
            group = sorted(rng.sample(free, rng.choice(degrees)), key=ids.index)
            free = [w for w in free if w not in group]
            view = video(rid, key, arrival=rng.uniform(0, now), steps=steps_total, done=done, deadline=deadline,
                         on=tuple(group))
            for w in group:
                residents[w].append(view)
        else:
            queued.append(video(rid, key, arrival=rng.uniform(0, now), steps=steps_total, done=done,
                                deadline=deadline, paused=rng.random() < 0.5, ready=rng.random() < 0.9))
    caps = {w: rng.randint(1, 4) for w in ids}
    for _ in range(rng.randint(0, 10)):
        key = rng.choice([IMG, BIG])
        steps_total = rng.randint(2, 30)
        view = img(f"i{next(counter)}", key=key, arrival=rng.uniform(0, now), steps=steps_total,
                   done=rng.randint(0, steps_total - 1), rows=rng.choice([1, 2]),
                   deadline=rng.choice([math.inf, now + rng.uniform(-1.0, 6.0)]))
        # Images never share a worker with a running video (a video's start sheds them).
        homes = [w for w in ids if not residents[w] or not residents[w][0].is_video]
        homes = [w for w in homes if len(residents[w]) < caps[w]]
        if homes and rng.random() < 0.5:
            residents[rng.choice(homes)].append(view)
        else:
            queued.append(dataclasses.replace(view, ready=rng.random() < 0.9))
    queued.sort(key=lambda v: v.arrival_time)
    sp_spread = any(len(v.workers) > 1 for rs in residents.values() for v in rs)
    # SP off only when no SP group is running: the test above covers the other case.
    sp_available = sp_spread or rng.random() < 0.7
    overhead = rng.choice([(), ((RequestKind.T2I, 0.01),), ((RequestKind.T2V, 0.2), (RequestKind.T2I, 0.0))])
    workers = {w: slot(max(caps[w], len(residents[w])), residents[w], **flags[w]) for w in ids}
    return snap(workers, queued, now=now, sp_available=sp_available, step_overhead_s=overhead)


@pytest.mark.parametrize("seed", range(400))
def test_random_rounds_give_executable_plans(seed):
    rng = random.Random(seed)
    snapshot = random_snapshot(rng)
    config = rng.choice(CONFIGS)
    policy, decision = schedule(snapshot, config)  # executable; busy workers only continue

    views = {v.request_id: v for v in snapshot.queued + snapshot.running}
    for plan in decision.plans:
        worker = snapshot.worker(plan.worker_id)
        assert not worker.decoding, "a decoding worker is outside the round"
        leaving = set(plan.export) | set(plan.release)
        admitted_videos = [rid for rid in plan.admit if views[rid].is_video]
        if admitted_videos:
            # A worker given to a video holds nothing else once the round is through.
            assert len(admitted_videos) == 1
            assert set(worker.running) <= leaving
            assert plan.admit == tuple(admitted_videos)
        elif plan.admit:
            # Images join a worker only once its video (if any) leaves.
            assert {rid for rid in worker.running if views[rid].is_video} <= leaving
        for group in plan.groups:
            if group.ranks or views[group.request_ids[0]].is_video:
                assert len(group.request_ids) == 1
            else:
                assert len(group.request_ids) <= config.image_max_batch
    if not snapshot.sp_available:
        assert all(not g.ranks for p in decision.plans for g in p.groups)
    if policy.last_decision is not None:
        assert plans_for(policy.last_decision, snapshot) == decision.plans


# -- the composed policy's switches of the spine -------------------------------------------------


def test_sticky_images_batch_residents_where_they_live():
    """Two workers each hold one image of the same shape: GenServe as published batches them
    together (one is exported to move), with sticky_images each steps where it is."""
    snapshot = snap({"w0": slot(4, [img("a", deadline=60.0)]), "w1": slot(4, [img("b", deadline=60.0)])})
    _, moving = schedule(snapshot)
    assert any(p.export for p in moving.plans)
    _, sticky = schedule(snapshot, GenServeConfig(sticky_images=True))
    assert {p.worker_id: (p.groups, p.export) for p in sticky.plans} == {
        "w0": (steps(("a",)), ()), "w1": (steps(("b",)), ())}


def test_admit_busy_fills_a_busy_workers_room_without_moving_anyone():
    """A worker inside a step, with room, and a waiting image: as published it only continues
    (the image waits for its boundary); with admit_busy its next plan admits the image."""
    snapshot = snap({"w0": slot(2, [img("a", deadline=60.0)], busy=True)}, [img("new", deadline=60.0)])
    policy = GenServePolicy(GenServeConfig(), FakeCosts())
    assert policy.schedule(snapshot).plans == (WorkerPlan("w0", groups=steps(("a",))),)
    policy = GenServePolicy(GenServeConfig(admit_busy=True), FakeCosts())
    decision = policy.schedule(snapshot)
    assert_executable(snapshot, decision)
    assert decision.plans == (WorkerPlan("w0", admit=("new",), groups=steps(("a", "new"))),)
    full = snap({"w0": slot(1, [img("a", deadline=60.0)], busy=True)}, [img("new", deadline=60.0)])
    assert policy.schedule(full).plans == (WorkerPlan("w0", groups=steps(("a",))),)  # no room: no export either


def test_sticky_images_export_the_residents_a_batch_leaves_out_instead_of_parking_them():
    """One worker holds images of two shapes; one batch steps. As published the other image
    stays parked on the worker (room enough); with sticky_images, where only its own worker's
    batch could take it, it is exported and batched anywhere next round."""
    snapshot = snap({"w0": slot(4, [img("a", deadline=5.0), img("b", deadline=60.0, key=BIG)])})
    _, published = schedule(snapshot)
    assert published.plans == (WorkerPlan("w0", groups=steps(("a",))),)
    _, sticky = schedule(snapshot, GenServeConfig(sticky_images=True))
    assert sticky.plans == (WorkerPlan("w0", groups=steps(("a",)), export=("b",)),)


def test_sticky_batches_of_waiting_images_go_to_empty_workers_first():
    from stepserve.policies.genserve.image_batching import PlannedBatch
    from stepserve.policies.genserve.materialize import materialize

    waiting = PlannedBatch(IMG, (ImageRequest("n", IMG, 2, 20, 9.0, 0.0),), 2, 0.04, (0, 0, 0), (0, 0, 0))
    assert materialize(("w0", "w1"), (), (), (waiting,), (0,)).batch_workers == ((0, "w0"),)
    assert materialize(("w0", "w1"), (), (), (waiting,), (0,), occupied={"w0"}).batch_workers == ((0, "w1"),)


def test_packed_resolutions_step_as_one_group_a_shape():
    from tests.cpu.policies.genserve.fakes import PackingFakeCosts

    snapshot = snap({"w0": slot(4)}, [img("s", deadline=9.0), img("b", deadline=10.0, key=BIG)])
    _, decision = schedule(snapshot, GenServeConfig(pack_resolutions=True), PackingFakeCosts())
    assert decision.plans == (WorkerPlan("w0", admit=("s", "b"), groups=steps(("s",), ("b",))),)
