"""Hand-made rounds: victims, elastic SP, deadline-aware resume, stability and edge cases.

FakeCosts numbers used below. Images: SMALL with CFG steps in 0.041 s alone (20 steps = 0.82 s).
Videos (480p, 81 frames, 40 steps): 4.0 / 2.05 / 1.15 / 0.85 s per step at degree 1/2/4/8, so
160 / 82 / 46 / 34 s to finish. Default round: 1 s.
"""

from __future__ import annotations

import dataclasses

import pytest

from stepserve.policies.genserve import (
    GenServeConfig,
    RoundInput,
    VideoAction,
    check_decision,
    decide_round,
    score_plan,
)
from stepserve.policies.types import ShapeKey

from tests.cpu.policies.genserve.fakes import LARGE, SMALL, FakeCosts, img, vid, workers

W8 = workers(8)
W4 = workers(4)
ELASTIC_OFF = GenServeConfig(elastic_sp=False)
GREEDY = GenServeConfig(dp=False)


def decide(inp, config=GenServeConfig(), costs=None):
    costs = costs or FakeCosts()
    decision = decide_round(inp, config, costs)
    check_decision(inp, config, decision)
    assert decision.score == score_plan(inp, config, costs, decision)
    return decision


def urgent_image(rid="urgent", key=SMALL):
    # 0.82 s of work, 1.5 s left: on time only if it starts now (waiting a round: 1.82 s).
    return img(rid, 1.5, key=key)


# -- victims ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [ELASTIC_OFF, dataclasses.replace(ELASTIC_OFF, dp=False)], ids=["dp", "greedy"])
def test_urgent_image_pauses_the_video_with_most_slack(config):
    relaxed = vid("relaxed", 500.0, on=W8[:4])  # slack 454 s at d=4
    pressed = vid("pressed", 60.0, on=W8[4:])  # slack 14 s; pausing a round still leaves it on time
    inp = RoundInput(0.0, W8, images=(urgent_image(),), videos=(relaxed, pressed))
    d = decide(inp, config)
    assert d.video("relaxed").action is VideoAction.PAUSE
    assert d.video("pressed").action is VideoAction.KEEP
    assert d.video("pressed").workers == W8[4:]
    assert d.preempted == ("relaxed",)
    assert d.stepping_images == ("urgent",)
    assert d.image_batches[0].worker_id in W8[:4]
    assert d.score.met == 3


def test_greedy_takes_no_victim_that_would_then_miss_its_deadline():
    # Pausing either video a round makes it late (1 + 46 > 46.5, 46.8): nobody gives way.
    a = vid("a", 46.5, on=W8[:4])
    b = vid("b", 46.8, on=W8[4:])
    inp = RoundInput(0.0, W8, images=(urgent_image(),), videos=(a, b))
    d = decide(inp, dataclasses.replace(ELASTIC_OFF, dp=False))
    assert [v.action for v in d.videos] == [VideoAction.KEEP, VideoAction.KEEP]
    assert d.waiting_images == ("urgent",) and d.preempted == ()


@pytest.mark.parametrize("config", [ELASTIC_OFF, dataclasses.replace(ELASTIC_OFF, dp=False)], ids=["dp", "greedy"])
def test_a_video_that_is_late_anyway_is_the_first_victim(config):
    late = vid("late", 40.0, on=W8[:4])  # 46 s of work left: lost whatever happens
    relaxed = vid("relaxed", 500.0, on=W8[4:])
    inp = RoundInput(0.0, W8, images=(urgent_image(),), videos=(late, relaxed))
    d = decide(inp, config)
    assert d.preempted == ("late",)
    assert d.video("relaxed").action is VideoAction.KEEP


def test_a_relaxed_image_does_not_preempt_a_more_pressed_video():
    video = vid("v", 46.0 + 5.0, on=W4)  # slack 5 s at its only degree
    relaxed = img("relaxed", 100.0)
    inp = RoundInput(0.0, W4, images=(relaxed,), videos=(video,))
    d = decide(inp, GenServeConfig(sp_degrees=(1, 2, 4), elastic_sp=False))
    assert d.video("v").action is VideoAction.KEEP
    assert d.waiting_images == ("relaxed",)
    # The same image, urgent now, takes the workers.
    urgent = RoundInput(0.0, W4, images=(urgent_image(),), videos=(video,))
    d = decide(urgent, GenServeConfig(sp_degrees=(1, 2, 4), elastic_sp=False))
    assert d.video("v").action is VideoAction.PAUSE


# -- elastic SP ------------------------------------------------------------------------------


def test_elastic_sp_downgrades_instead_of_pausing():
    inp = RoundInput(0.0, W8, images=(urgent_image(),), videos=(vid("v", 100.0, on=W8),))
    d = decide(inp)
    v = d.video("v")
    assert v.action is VideoAction.RUN
    assert v.workers == W8[:4]  # a prefix of its own group
    assert v.predicted_finish == pytest.approx(46.0)
    assert d.downgraded == ("v",) and d.preempted == ()
    assert d.image_batches[0].worker_id == "w4"
    assert d.idle_workers == W8[5:]


def test_idle_workers_upgrade_a_video():
    inp = RoundInput(0.0, W8, videos=(vid("v", 100.0, on=("w2", "w3")),))
    v = decide(inp).video("v")
    assert v.action is VideoAction.RUN
    assert v.workers[:2] == ("w2", "w3")
    assert sorted(v.workers) == sorted(W8)


def test_no_upgrade_when_more_workers_are_not_faster():
    costs = FakeCosts(video_steps={"wan": {1: 3.0, 2: 2.0, 4: 2.0, 8: 2.0}})
    inp = RoundInput(0.0, W8, videos=(vid("v", 100.0, on=("w2", "w3")),))
    d = decide(inp, costs=costs)
    assert d.video("v").action is VideoAction.KEEP
    assert d.idle_workers == ("w0", "w1", "w4", "w5", "w6", "w7")


def test_two_videos_share_the_cluster():
    inp = RoundInput(0.0, W8, videos=(vid("a", 100.0, on=W8), vid("b", 100.0, arrival=1.0)))
    d = decide(inp)
    assert d.video("a").degree == 4 and d.video("a").workers == W8[:4]
    assert d.video("b").action is VideoAction.RUN and d.video("b").workers == W8[4:]


# -- deadline-aware resume -------------------------------------------------------------------


def test_paused_video_resumes_when_workers_are_idle():
    d = decide(RoundInput(0.0, W4, videos=(vid("v", 1000.0, paused=True),)), GenServeConfig(sp_degrees=(1, 2, 4)))
    assert d.video("v").action is VideoAction.RUN and d.video("v").workers == W4


@pytest.mark.parametrize("deadline,resumes", [(46.5, True), (200.0, False)], ids=["tight", "relaxed"])
def test_paused_video_resumes_when_its_budget_is_tight(deadline, resumes):
    # Four image batches (batch size 1) with 4 s of slack each outweigh a relaxed video; a video
    # that would miss its deadline by waiting one more round (1 + 46 > 46.5) takes the workers.
    config = GenServeConfig(sp_degrees=(1, 2, 4), image_max_batch=1)
    images = tuple(img(f"i{k}", 5.0) for k in range(4))
    inp = RoundInput(0.0, W4, images=images, videos=(vid("v", deadline, paused=True),))
    d = decide(inp, config)
    if resumes:
        assert d.video("v").action is VideoAction.RUN and d.video("v").degree == 4
        assert d.image_batches == () and d.score.met == 5
    else:
        assert d.video("v").action is VideoAction.WAIT
        assert len(d.image_batches) == 4 and d.score.met == 5


# -- stability -------------------------------------------------------------------------------


def test_unchanged_video_is_a_keep_on_the_same_workers():
    inp = RoundInput(0.0, W4, videos=(vid("v", 100.0, on=("w3", "w1")),))
    d = decide(inp, GenServeConfig(sp_degrees=(1, 2)))
    assert d.video("v").action is VideoAction.KEEP
    assert d.video("v").workers == ("w3", "w1")


def test_images_stay_where_they_are_resident():
    images = (img("r", 30.0, worker="w2"), img("r2", 30.0, worker="w2"))
    inp = RoundInput(0.0, W4, images=images, videos=(vid("v", 1000.0),))
    d = decide(inp, GenServeConfig(sp_degrees=(1, 2)))
    assert [(b.worker_id, b.request_ids, b.admit) for b in d.image_batches] == [("w2", ("r", "r2"), ())]
    assert d.video("v").workers == ("w0", "w1")


def test_a_moved_or_new_image_is_admitted():
    images = (img("new", 30.0), img("res", 30.0, worker="w1"))
    d = decide(RoundInput(0.0, ("w0", "w1"), images=images))
    (batch,) = d.image_batches
    assert batch.worker_id == "w1" and batch.admit == ("new",)


# -- edge cases ------------------------------------------------------------------------------


def test_empty_round():
    d = decide(RoundInput(5.0, W4))
    assert d.videos == () and d.image_batches == () and d.idle_workers == W4
    assert d.score.key == (0, 0, 0)


def test_no_workers_at_all():
    inp = RoundInput(0.0, (), images=(img("i", 5.0),), videos=(vid("v", 100.0, paused=True),))
    d = decide(inp)
    assert d.video("v").action is VideoAction.WAIT and d.waiting_images == ("i",)


@pytest.mark.parametrize("dp", [True, False])
def test_no_free_workers_without_preemption(dp):
    config = GenServeConfig(preemption=False, elastic_sp=False, dp=dp)
    inp = RoundInput(0.0, W4, images=(urgent_image(),), videos=(vid("v", 100.0, on=W4),))
    d = decide(inp, config)
    assert d.video("v").action is VideoAction.KEEP
    assert d.waiting_images == ("urgent",) and d.idle_workers == ()
    assert d.score.met == 1  # the image is lost


def test_only_images_run_in_edf_order_on_the_workers_there_are():
    images = (img("late-deadline", 9.0, key=LARGE), img("a", 2.0), img("b", 3.0, key=ShapeKey("sd", 256, 256)),
              img("c", 2.5, key=ShapeKey("sd", 768, 768)))
    d = decide(RoundInput(0.0, ("w0", "w1"), images=images))
    assert [b.request_ids for b in d.image_batches] == [("a",), ("c",)]
    assert d.waiting_images == ("late-deadline", "b")


def test_missed_deadlines_get_only_what_nobody_else_needs():
    images = (img("late", -1.0, key=LARGE), img("ok", 2.0))
    d = decide(RoundInput(0.0, ("w0",), images=images))
    assert d.stepping_images == ("ok",) and d.waiting_images == ("late",)
    d = decide(RoundInput(0.0, ("w0", "w1"), images=images))
    assert sorted(d.stepping_images) == ["late", "ok"]
    # A late video still runs on idle workers.
    d = decide(RoundInput(50.0, ("w0", "w1"), videos=(vid("v", 40.0, paused=True),)))
    assert d.video("v").action is VideoAction.RUN and d.score.met == 0


def test_sixty_four_workers():
    ws = workers(64)
    videos = tuple(vid(f"v{k}", 60.0 + 10 * k, on=ws[8 * k: 8 * k + 8]) for k in range(4))
    videos += tuple(vid(f"q{k}", 200.0, arrival=k) for k in range(4))
    images = tuple(img(f"i{k}", 2.0 + k, key=ShapeKey("sd", 256 + 64 * (k % 5), 256)) for k in range(30))
    d = decide(RoundInput(0.0, ws, images=images, videos=videos))
    assert d.score.met == 38
    assert all(d.video(v.job_id).degree > 0 for v in videos)


# -- the greedy (no-DP) allocator --------------------------------------------------------------


def test_fcfs_baseline_blocks_the_head_of_the_line():
    config = GenServeConfig(dp=False, preemption=False, elastic_sp=False, fixed_sp_degree=2, sp_degrees=(1, 2))
    inp = RoundInput(1.0, ("w0", "w1"), images=(img("i", 2.5, arrival=1.0),), videos=(vid("v", 300.0),))
    d = decide(inp, config)
    assert d.video("v").action is VideoAction.RUN and d.waiting_images == ("i",)
    # With preemption, the urgent image takes a worker from the video just admitted.
    d = decide(inp, dataclasses.replace(config, preemption=True))
    assert d.video("v").action is VideoAction.WAIT and d.stepping_images == ("i",)
    # The DP sees the same trade-off without needing a victim rule.
    assert decide(inp, dataclasses.replace(config, dp=True)).stepping_images == ("i",)


def test_greedy_takes_the_smallest_on_time_degree_then_upgrades_with_what_is_left():
    config = GenServeConfig(dp=False, sp_degrees=(1, 2, 4))
    images = (img("a", 30.0, arrival=1.0), img("b", 30.0, arrival=2.0, key=LARGE))
    inp = RoundInput(2.0, W4, images=images, videos=(vid("v", 92.0, arrival=0.0),))  # 82 s at d=2
    d = decide(inp, config)
    assert d.video("v").degree == 2 and len(d.image_batches) == 2
    d = decide(RoundInput(2.0, W4, videos=(vid("v", 92.0),)), config)
    assert d.video("v").degree == 4


def test_greedy_downgrades_a_victim_when_sp_is_elastic():
    inp = RoundInput(0.0, W8, images=(urgent_image(),), videos=(vid("v", 100.0, on=W8),))
    d = decide(inp, GREEDY)
    assert d.video("v").workers == W8[:4] and d.downgraded == ("v",)
    assert d.stepping_images == ("urgent",)


def test_greedy_gives_spare_workers_to_the_least_slack_video_first():
    ws = workers(6)
    pressed = vid("pressed", 90.0, on=("w0", "w1"))  # 82 s left at d=2: slack 8 s
    relaxed = vid("relaxed", 900.0, on=("w2", "w3"))
    d = decide(RoundInput(0.0, ws, videos=(relaxed, pressed)), dataclasses.replace(GREEDY, sp_degrees=(1, 2, 4)))
    assert d.video("pressed").workers == ("w0", "w1", "w4", "w5")
    assert d.video("relaxed").action is VideoAction.KEEP


# -- placement on a pool where some workers are mid-step --------------------------------------


@pytest.mark.parametrize("config", [GenServeConfig(), GREEDY])
def test_a_new_image_goes_to_a_free_worker_not_one_inside_a_step(config):
    # w0 and w1 are inside other steps; the image must not queue behind w0's boundary while w2
    # idles (the score is the same either way: only the placement changes).
    busy = frozenset({"w0", "w1"})
    inp = RoundInput(0.0, W4, images=(img("i", 5.0),), busy=busy)
    d = decide(inp, config)
    (batch,) = d.image_batches
    assert batch.worker_id == "w2"
    assert d.score == decide(RoundInput(0.0, W4, images=(img("i", 5.0),)), config).score


def test_a_starting_video_takes_free_workers_first_and_images_get_free_ones_before_it():
    # Two free workers (w1, w3): the urgent image takes one, the video's group the other plus
    # a busy one (it starts at that worker's boundary, costing it a step, not the image its SLO).
    inp = RoundInput(0.0, W4, images=(img("i", 1.0),), videos=(vid("v", 1000.0),),
                     busy=frozenset({"w0", "w2"}))
    d = decide(inp, GenServeConfig(sp_degrees=(1, 2)))
    assert d.batch_on("w1") is not None
    assert d.video("v").workers[0] == "w3" and len(d.video("v").workers) == 2


def test_spread_images_takes_empty_free_workers_and_keeps_one_back_per_waiting_video():
    config = GenServeConfig(spread_images=True, sticky_images=True)
    images = tuple(img(f"i{k}", 30.0) for k in range(3))
    alone = decide_round(RoundInput(0.0, workers(3), images, ()), config, FakeCosts())
    assert sorted(len(b.request_ids) for b in alone.image_batches) == [1, 1, 1]
    with_video = decide_round(RoundInput(0.0, workers(3), images, (vid("v", 1e6),)), config, FakeCosts())
    assert len(with_video.image_batches) <= 2
    assert len(decide_round(RoundInput(0.0, workers(3), images, ()), GenServeConfig(), FakeCosts()).image_batches) == 1
