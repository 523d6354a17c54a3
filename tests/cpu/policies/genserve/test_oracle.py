"""The knapsack DP against a brute-force oracle, and properties over random rounds.

The oracle tries every allocation of workers on small rounds (<= 4 workers, <= 3 videos, a few
images): every degree 0..N for every video that the switches permit (dominated degrees
included, so candidate pruning is checked too), every number of workers left to the EDF image
plan, each built into a concrete decision and scored from scratch with `score_plan`. The DP
must reach the best score exactly (scores are integers).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from stepserve.policies.genserve import (
    GenServeConfig,
    ImageBatch,
    PlanScore,
    RoundDecision,
    RoundInput,
    VideoAction,
    VideoDecision,
    check_decision,
    decide_round,
    score_plan,
)
from stepserve.policies.genserve.costs import MemoizedCosts
from stepserve.policies.genserve.image_batching import edf_batches

from tests.cpu.policies.genserve.fakes import FakeCosts, PackingFakeCosts, random_round, with_addons

SWITCHES = [
    dict(preemption=p, elastic_sp=e) for p, e in itertools.product((True, False), (True, False))
]


def permitted(job, d, config, n):
    """The switches' rules, written out independently of candidates.py."""
    if d == 0:
        return not job.running or config.preemption
    if d > n:
        return False
    if not config.elastic_sp:
        return d == (job.degree if job.running else config.fixed_sp_degree)
    return d in config.sp_degrees or (job.running and d == job.degree)


def build(inp, degrees, batches):
    """A concrete decision: running videos keep what they can of their group."""
    kept = [job.workers[:d] for job, d in zip(inp.videos, degrees)]
    free = [w for w in inp.workers if not any(w in k for k in kept)]
    videos = []
    for job, d, own in zip(inp.videos, degrees, kept):
        if d == 0:
            videos.append(VideoDecision(job.job_id, VideoAction.PAUSE if job.running else VideoAction.WAIT))
            continue
        group = tuple(own) + tuple(free.pop(0) for _ in range(d - len(own)))
        action = VideoAction.KEEP if group == job.workers else VideoAction.RUN
        videos.append(VideoDecision(job.job_id, action, group))
    image_batches = []
    for b in batches:
        w = free.pop(0)
        ids = tuple(m.request_id for m in b.members)
        admit = tuple(m.request_id for m in b.members if m.worker_id != w)
        image_batches.append(ImageBatch(w, b.shape_key, ids, admit, b.step_s))
    return RoundDecision(inp.now, tuple(videos), tuple(image_batches), PlanScore(0, 0, 0))


def oracle(inp, config, costs):
    n = len(inp.workers)
    batches = edf_batches(inp.images, inp.now, config, costs, n).batches
    choices = [[d for d in range(n + 1) if permitted(v, d, config, n)] for v in inp.videos]
    best = None
    for degrees in itertools.product(*choices):
        left = n - sum(degrees)
        if left < 0:
            continue
        for g in range(min(left, len(batches)) + 1):
            plan = build(inp, degrees, batches[:g])
            check_decision(inp, config, plan)
            key = score_plan(inp, config, costs, plan).key
            if best is None or key > best:
                best = key
    return best


def small_rounds(count, seed, config):
    rng = random.Random(seed)
    for _ in range(count):
        yield random_round(rng, rng.randint(1, 4), rng.randint(0, 3), rng.randint(0, 4), config)


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: f"preempt={s['preemption']},elastic={s['elastic_sp']}")
def test_dp_matches_brute_force(switches):
    config = GenServeConfig(sp_degrees=(1, 2, 4), **switches)
    costs = MemoizedCosts(FakeCosts())
    for k, inp in enumerate(small_rounds(150, 7, config)):
        config_k = dataclasses.replace(config, round_s=(0.0, 0.5, 2.0)[k % 3], image_max_batch=1 + k % 3)
        decision = decide_round(inp, config_k, costs)
        assert decision.score.key == oracle(inp, config_k, costs), inp


@pytest.mark.parametrize("reserve", [1, 2, 4])
def test_dp_matches_brute_force_with_workers_reserved_for_expected_images(reserve):
    """A reserved worker (the composed policy's headroom) is worth RESERVE_WEIGHT when left idle:
    the DP must still find the best plan, and it never runs fewer requests to keep one."""
    config = GenServeConfig(sp_degrees=(1, 2, 4))
    costs = MemoizedCosts(FakeCosts())
    for inp in small_rounds(120, 13 + reserve, config):
        inp = dataclasses.replace(inp, reserve=reserve)
        decision = decide_round(inp, config, costs)
        assert decision.score.key == oracle(inp, config, costs), inp
        plain = decide_round(dataclasses.replace(inp, reserve=0), config, costs)
        assert decision.score.met == plain.score.met
        assert len(decision.stepping_images) >= len(plain.stepping_images)


def test_dp_matches_brute_force_with_addons():
    """Images with ControlNets and LoRAs: batches priced with their add-ons, by the solver and by
    `score_plan` alike."""
    config = GenServeConfig(sp_degrees=(1, 2, 4))
    costs = MemoizedCosts(FakeCosts(controlnet_row_s=0.004, lora_row_s=0.002))
    rng = random.Random(29)
    for k, inp in enumerate(small_rounds(150, 31, config)):
        inp = with_addons(rng, inp)
        config_k = dataclasses.replace(config, image_max_batch=1 + k % 4)
        decision = decide_round(inp, config_k, costs)
        assert decision.score.key == oracle(inp, config_k, costs), inp


def test_dp_matches_brute_force_with_sublinear_and_unsupported_degrees():
    # Degree 4 is no faster than 2 for "flat", degree 2 is impossible for "odd", and each
    # degree is only a little faster for "slight".
    rng = random.Random(3)
    config = GenServeConfig(sp_degrees=(1, 2, 4), resume_degree=2)
    for _ in range(60):
        inp = random_round(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(0, 3), config)
        table = {"flat": {1: 2.0, 2: 1.1, 4: 1.1}, "odd": {1: 3.0, 4: 0.9}, "slight": {1: 2.0, 2: 1.95, 4: 1.9}}
        videos = tuple(dataclasses.replace(v, model=rng.choice(["flat", "odd", "slight", "wan"])) if not v.running
                       else v for v in inp.videos)
        inp = dataclasses.replace(inp, videos=videos)
        local = MemoizedCosts(FakeCosts(video_steps=table))
        decision = decide_round(inp, config, local)
        assert decision.score.key == oracle(inp, config, local)


def test_oracle_can_tell_plans_apart():
    # Guards the oracle itself: on a round with a real trade-off, plans score differently,
    # so "DP == oracle" is not satisfied by a constant score.
    config = GenServeConfig(sp_degrees=(1, 2, 4))
    costs = MemoizedCosts(FakeCosts())
    inp = next(r for r in small_rounds(50, 11, config) if len(r.videos) >= 2 and r.images)
    batches = edf_batches(inp.images, inp.now, config, costs, len(inp.workers)).batches
    worst = score_plan(inp, config, costs, build(inp, [0 if not v.running else v.degree for v in inp.videos], []))
    assert oracle(inp, config, costs) > worst.key or not batches


# -- properties over random rounds, every switch combination -----------------------------------

ALL_CONFIGS = [
    GenServeConfig(dp=dp, preemption=p, elastic_sp=e)
    for dp, p, e in itertools.product((True, False), repeat=3)
]


def random_rounds(count, seed, config, n_workers=8):
    rng = random.Random(seed)
    for _ in range(count):
        yield random_round(rng, n_workers, rng.randint(0, 5), rng.randint(0, 12), config)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: f"dp={c.dp},pre={c.preemption},el={c.elastic_sp}")
def test_decisions_are_valid_and_scored_honestly(config):
    costs = MemoizedCosts(FakeCosts())
    for k, inp in enumerate(random_rounds(40, 5, config)):
        inp = dataclasses.replace(inp, reserve=k % 3)
        decision = decide_round(inp, config, costs)
        check_decision(inp, config, decision)
        assert decision.score == score_plan(inp, config, costs, decision)
        used = [w for v in decision.videos for w in v.workers] + [b.worker_id for b in decision.image_batches]
        assert sorted(used + list(decision.idle_workers)) == sorted(inp.workers)
        stepping = set(decision.stepping_images)
        assert stepping.isdisjoint(decision.waiting_images)
        assert stepping | set(decision.waiting_images) == {i.request_id for i in inp.images}


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("addons", [False, True])
def test_composed_spine_decisions_are_valid_and_scored_honestly(packing, addons):
    """The composed policy's spine switches (sticky residents, busy admission, packed
    resolutions on costs that price them), with and without add-ons: every decision executable
    (an image with add-ons never in a packed batch) and its score the plan's."""
    config = GenServeConfig(sticky_images=True, admit_busy=True, pack_resolutions=packing)
    costs = MemoizedCosts(PackingFakeCosts(controlnet_row_s=0.004, lora_row_s=0.002))
    rng = random.Random(37)
    packed = 0
    for k, inp in enumerate(random_rounds(60, 23, config)):
        inp = dataclasses.replace(inp, reserve=k % 3)
        if addons:
            inp = with_addons(rng, inp)
        decision = decide_round(inp, config, costs)
        check_decision(inp, config, decision)
        assert decision.score == score_plan(inp, config, costs, decision)
        shapes = {i.request_id: i.shape_key for i in inp.images}
        packed += sum(len({shapes[r] for r in b.request_ids}) > 1 for b in decision.image_batches)
    assert (packed > 0) == packing


@pytest.mark.parametrize("dp", [True, False])
def test_preemption_off_never_pauses_a_running_video(dp):
    config = GenServeConfig(dp=dp, preemption=False)
    for inp in random_rounds(60, 9, config):
        decision = decide_round(inp, config, FakeCosts())
        for job in inp.videos:
            if job.running:
                assert decision.video(job.job_id).action in (VideoAction.KEEP, VideoAction.RUN)
        assert decision.preempted == ()


@pytest.mark.parametrize("dp", [True, False])
def test_fixed_sp_never_changes_a_degree(dp):
    config = GenServeConfig(dp=dp, elastic_sp=False, fixed_sp_degree=2)
    for inp in random_rounds(60, 13, config):
        decision = decide_round(inp, config, FakeCosts())
        for job in inp.videos:
            chosen = decision.video(job.job_id)
            if chosen.workers:
                assert chosen.degree == (job.degree if job.running else 2)
        assert decision.downgraded == ()


def test_dp_is_never_worse_than_greedy():
    for switches in SWITCHES:
        dp_config = GenServeConfig(**switches)
        greedy_config = dataclasses.replace(dp_config, dp=False)
        costs = MemoizedCosts(FakeCosts())
        for inp in random_rounds(40, 17, dp_config):
            dp_score = decide_round(inp, dp_config, costs).score
            greedy_score = decide_round(inp, greedy_config, costs).score
            assert dp_score >= greedy_score


def test_decisions_are_deterministic_and_ignore_input_order():
    config = GenServeConfig()
    rng = random.Random(21)
    for inp in random_rounds(40, 19, config):
        first = decide_round(inp, config, FakeCosts())
        assert decide_round(inp, config, FakeCosts()) == first
        videos, images = list(inp.videos), list(inp.images)
        rng.shuffle(videos)
        rng.shuffle(images)
        shuffled = decide_round(RoundInput(inp.now, inp.workers, tuple(images), tuple(videos)), config, FakeCosts())
        assert {v.job_id: v for v in shuffled.videos} == {v.job_id: v for v in first.videos}
        assert shuffled.image_batches == first.image_batches
        assert shuffled.score == first.score
        assert shuffled.preempted == first.preempted
