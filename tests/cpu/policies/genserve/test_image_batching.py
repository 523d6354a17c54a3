"""EDF batching of same-shape images with the enlarged-batch deadline check (Algorithm 1 line 3)."""

from __future__ import annotations

import math

from stepserve.policies.genserve import GenServeConfig
from stepserve.policies.genserve.image_batching import edf_batches
from stepserve.policies.genserve.scoring import add
from stepserve.policies.types import ShapeKey

from tests.cpu.policies.genserve.fakes import LARGE, FakeCosts, PackingFakeCosts, img

# With FakeCosts, a SMALL image with CFG (2 rows) steps in 0.041 s alone: 20 steps = 0.82 s.


def ids(plan):
    return [[m.request_id for m in b.members] for b in plan.batches]


def test_same_shape_images_share_a_batch_in_deadline_order():
    images = [img("s3", 3.0), img("s1", 2.0), img("big", 2.5, key=LARGE), img("s4", 4.0)]
    plan = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)
    assert ids(plan) == [["s1", "s3", "s4"], ["big"]]
    assert plan.batches[0].rows == 6
    assert math.isclose(plan.batches[0].step_s, 0.02 + 0.04 * 6 * 512 * 512 / 1e6)


def test_max_batch_splits_in_deadline_order():
    images = [img(f"s{i}", 2.0 + i) for i in range(5)]
    plan = edf_batches(images, 0.0, GenServeConfig(image_max_batch=2), FakeCosts(), 4)
    assert ids(plan) == [["s0", "s1"], ["s2", "s3"], ["s4"]]


def test_join_that_would_make_a_member_late_opens_a_new_batch():
    # Alone the first one needs 0.82 s; with a second CFG image 20 * 0.062 = 1.24 s > 0.85.
    images = [img("tight", 0.85), img("other", 10.0)]
    plan = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)
    assert ids(plan) == [["tight"], ["other"]]
    # With room for both deadlines they share.
    plan = edf_batches([img("tight", 1.3), img("other", 10.0)], 0.0, GenServeConfig(), FakeCosts(), 4)
    assert ids(plan) == [["tight", "other"]]


def test_addons_are_priced_with_the_batch():
    """SwiftDiffusion's add-ons cost a forward time: a ControlNet call over the rows of the members
    that use it, LoRA updates per row. A join that fits at the plain price but not with the
    add-ons opens a new batch."""
    costs = FakeCosts(controlnet_row_s=0.01, lora_row_s=0.005)
    alone = edf_batches([img("cn", 10.0, controlnets=("canny",), loras=1)], 0.0, GenServeConfig(), costs, 4)
    assert math.isclose(alone.batches[0].step_s, 0.041 + 0.01 * 2 + 0.005 * 2, rel_tol=1e-3)
    # Plain, both fit in 1.3 s (20 x 0.062 = 1.24 s); two canny calls over 4 rows add 0.04 s a step.
    plain = [img("tight", 1.3), img("other", 10.0)]
    assert ids(edf_batches(plain, 0.0, GenServeConfig(), costs, 4)) == [["tight", "other"]]
    both = [img("tight", 1.3, controlnets=("canny",)), img("other", 10.0, controlnets=("canny",))]
    assert ids(edf_batches(both, 0.0, GenServeConfig(), costs, 4)) == [["tight"], ["other"]]
    # Calls are per ControlNet: two requests of one ControlNet make one call over their rows.
    shared = edf_batches([img("a", 10.0, controlnets=("canny",)), img("b", 10.0, controlnets=("canny", "depth"))],
                         0.0, GenServeConfig(), costs, 4).batches[0]
    assert math.isclose(shared.step_s, 0.02 + 0.04 * 4 * 512 * 512 / 1e6 + 0.01 * (4 + 2), rel_tol=1e-9)


def test_images_with_addons_are_not_packed():
    """A packed forward runs no add-on (`patchedserve.mixed_costs.packable`): with packing on,
    an image with a ControlNet batches only with its own resolution."""
    config = GenServeConfig(pack_resolutions=True)
    images = [img("small", 10.0), img("large", 10.0, key=LARGE), img("cn", 10.0, key=LARGE, controlnets=("canny",))]
    plan = edf_batches(images, 0.0, config, PackingFakeCosts(controlnet_row_s=0.01), 4)
    assert sorted(sorted(b) for b in ids(plan)) == [["cn"], ["large", "small"]]


def test_images_without_slo_join_no_batch_beyond_a_workers_share_of_the_work():
    """The end of a burst: w0's batch has room, the others are full and finish next step. Waiting
    images without an SLO (all arrived long ago) fill w0's batch only up to a worker's share of
    the images' work (186 solo steps over 4 workers: 3 of 8 join); the rest wait for the workers
    freeing up. Had they just arrived, as many again would be expected within one's run: the
    share doubles nearly (5 join). With SLOs, EDF batching fills the room as before."""
    inf = math.inf
    residents = [img(f"r0-{i}", inf, steps=1, worker="w0") for i in range(2)]
    residents += [img(f"r{w}-{i}", inf, steps=1, worker=f"w{w}") for w in (1, 2, 3) for i in range(8)]
    config = GenServeConfig(sticky_images=True, spread_images=True)

    def joined(waiting):
        plan = edf_batches(residents + waiting, 100.0, config, FakeCosts(), 4)
        home = next(b for b in plan.batches if b.members[0].worker_id == "w0")
        return [m.request_id for m in home.members if m.worker_id is None]

    assert joined([img(f"q{i}", inf, steps=20, arrival=1.0 + i) for i in range(8)]) == ["q0", "q1", "q2"]
    assert len(joined([img(f"q{i}", inf, steps=20, arrival=99.2 + 0.05 * i) for i in range(8)])) == 5
    assert len(joined([img(f"q{i}", 200.0, steps=20, arrival=1.0 + i) for i in range(8)])) == 6


def test_newcomer_that_would_be_late_in_the_batch_goes_alone():
    # "short" stays on time in a batch of two (5 * 0.062 s); "long" meets its deadline alone
    # (20 * 0.041 = 0.82 s) but not in the batch (20 * 0.062 = 1.24 s).
    images = [img("short", 1.0, steps=5), img("long", 1.0, steps=20, arrival=1.0)]
    plan = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)
    assert ids(plan) == [["short"], ["long"]]
    # A newcomer that is late even alone costs nobody anything by joining.
    images = [img("short", 1.0, steps=5), img("hopeless", 0.5, steps=20, arrival=1.0)]
    plan = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)
    assert ids(plan) == [["short", "hopeless"]]


def test_late_images_go_to_the_back_and_fill_batches():
    images = [img("late", -1.0), img("ok", 5.0, key=LARGE), img("late2", 0.5)]
    plan = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)
    # Both SMALL ones are late even alone, so they rank after the on-time LARGE one and share.
    assert ids(plan) == [["ok"], ["late", "late2"]]


def test_prefix_is_the_value_of_running_the_first_g_batches():
    images = [img("a", 1.0), img("b", 1.5, key=LARGE), img("c", 30.0, key=ShapeKey("sd", 256, 256)),
              img("late", -3.0, key=ShapeKey("x", 64, 64))]
    config = GenServeConfig()
    plan = edf_batches(images, 0.0, config, FakeCosts(), 6)
    assert len(plan.prefix) == 7
    assert len(plan.batches) == 4
    for g in range(7):
        assert plan.value(g) == plan.value_of(range(min(g, 4)))
    for g in range(6):
        assert plan.prefix[g] <= plan.prefix[g + 1]  # more workers never hurt the images
    everyone_waits = (0, 0, 0)
    for b in plan.batches:
        everyone_waits = add(everyone_waits, b.waiting_value)
    assert plan.prefix[0] == everyone_waits


def test_prefix_stops_at_the_worker_count():
    images = [img(f"i{k}", 5.0, key=ShapeKey("sd", 64 * (k + 1), 64)) for k in range(5)]
    plan = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 2)
    assert len(plan.batches) == 5 and len(plan.prefix) == 3


def test_an_image_without_a_cost_never_runs():
    class NoLarge(FakeCosts):
        def step_seconds(self, batch):
            return math.inf if batch.height == 1024 else super().step_seconds(batch)

    plan = edf_batches([img("big", 5.0, key=LARGE), img("s", 5.0)], 0.0, GenServeConfig(), NoLarge(), 2)
    assert ids(plan) == [["s"]]
    assert [i.request_id for i in plan.unbatchable] == ["big"]


# -- the composed policy's switches ---------------------------------------------------------------


def test_sticky_residents_of_a_worker_are_one_batch_ahead_of_waiting_images():
    """With sticky_images a worker's residents stay one batch even past the allowance (split, one
    half could only move or park), late ones keep their deadline order, and resident batches rank
    ahead of batches of waiting images (they hold their workers already)."""
    images = [img("urgent", 0.9), img("tight", 0.85, worker="w1"), img("other", 10.0, worker="w1"),
              img("late", -1.0, worker="w2")]
    published = edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)
    assert ids(published) == [["tight"], ["urgent"], ["other", "late"]]
    sticky = edf_batches(images, 0.0, GenServeConfig(sticky_images=True), FakeCosts(), 4)
    assert ids(sticky) == [["late"], ["tight", "other"], ["urgent"]]


def test_packing_puts_resolutions_of_a_model_in_one_batch_priced_as_one_forward():
    images = [img("small", 4.0), img("big", 5.0, key=LARGE)]
    assert ids(edf_batches(images, 0.0, GenServeConfig(pack_resolutions=True), FakeCosts(), 4)) == \
        [["small"], ["big"]]  # costs that cannot price a packed forward: one shape a batch
    plan = edf_batches(images, 0.0, GenServeConfig(pack_resolutions=True), PackingFakeCosts(), 4)
    assert ids(plan) == [["small", "big"]]
    assert plan.batches[0].rows == 4
    assert math.isclose(plan.batches[0].step_s, 0.02 + 0.04 * 2 * (512 * 512 + 1024 * 1024) / 1e6)
    assert ids(edf_batches(images, 0.0, GenServeConfig(), PackingFakeCosts(), 4)) == [["small"], ["big"]]


def test_sticky_residents_form_their_batch_before_a_waiting_image_is_checked_against_it():
    """A waiting image fits beside one resident of w0 but not beside both: the worker's batch is
    whole (both residents) before the waiting image is checked, so it opens a batch of its own
    rather than join one that the second resident then makes it miss its deadline in."""
    images = [img("r1", 1.4, worker="w0"), img("n", 1.5), img("r2", 50.0, worker="w0")]
    plan = edf_batches(images, 0.0, GenServeConfig(sticky_images=True), FakeCosts(), 4)
    assert ids(plan) == [["r1", "r2"], ["n"]]


def test_spread_opens_batches_for_empty_workers_before_joining():
    images = [img("a", 5.0), img("b", 6.0), img("c", 7.0)]
    assert ids(edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4)) == [["a", "b", "c"]]
    assert ids(edf_batches(images, 0.0, GenServeConfig(), FakeCosts(), 4, spread=2)) == [["a", "c"], ["b"]]
    # Residents do not count: they batch where they live.
    images.append(img("r", 1.0, worker="w3"))
    assert ids(edf_batches(images, 0.0, GenServeConfig(sticky_images=True), FakeCosts(), 4, spread=2)) == \
        [["r"], ["a", "c"], ["b"]]


def test_spread_puts_an_image_without_an_slo_in_the_least_loaded_batch():
    """With a deadline the first batch that keeps everyone on time takes the image (EDF
    batching); without one the first batch would take every image, so it goes where it steps
    fastest."""
    residents = [img("r0", math.inf, worker="w0", rows=2), img("r1", math.inf, worker="w0", rows=2),
                 img("r2", math.inf, worker="w1", rows=2)]
    config = GenServeConfig(sticky_images=True, spread_images=True)
    plan = edf_batches(residents + [img("edit", math.inf)], 0.0, config, FakeCosts(), 2)
    assert ids(plan) == [["r0", "r1"], ["r2", "edit"]]
    first_fit = edf_batches(residents + [img("edit", math.inf)], 0.0, GenServeConfig(sticky_images=True), FakeCosts(), 2)
    assert ids(first_fit) == [["r0", "r1", "edit"], ["r2"]]


def test_an_edit_of_a_cached_template_is_priced_at_its_computed_share():
    # 2 rows of 512x512 at share 0.2: 0.02 + 0.04 * 2 * 0.262144 * 0.2 (InstGenIE's masked forward).
    edit = edf_batches([img("e", math.inf, share=0.2)], 0.0, GenServeConfig(), FakeCosts(), 1)
    assert math.isclose(edit.batches[0].step_s, 0.02 + 0.04 * 2 * 0.262144 * 0.2)
    # A batch's share is its rows' weighted mean, rounded up to a hundredth (a conservative price).
    mixed = edf_batches([img("e", math.inf, share=0.2), img("f", math.inf, share=0.333)], 0.0, GenServeConfig(),
                        FakeCosts(), 1)
    assert math.isclose(mixed.batches[0].step_s, 0.02 + 0.04 * 4 * 0.262144 * 0.27)


def test_an_edit_without_an_slo_joins_the_batch_it_steps_fastest_in():
    """Mask-aware placement (InstGenIE §4.4) in the spine: two batches of two edits each, one of
    edits computing a tenth of their tokens; by request count they tie, by predicted step time
    the masked one is lighter, and a new edit joins it."""
    residents = [img("full0", math.inf, worker="w0"), img("full1", math.inf, worker="w0"),
                 img("masked0", math.inf, worker="w1", share=0.1), img("masked1", math.inf, worker="w1", share=0.1)]
    config = GenServeConfig(sticky_images=True, spread_images=True)
    plan = edf_batches(residents + [img("edit", math.inf, share=0.5)], 0.0, config, FakeCosts(), 2)
    assert ids(plan) == [["full0", "full1"], ["masked0", "masked1", "edit"]]


def test_an_edit_of_a_cached_template_is_not_packed():
    """A packed forward computes every token: an edit computing its masked share keeps a batch
    of its own shape."""
    config = GenServeConfig(pack_resolutions=True)
    plan = edf_batches([img("a", 5.0), img("b", 5.0, key=LARGE), img("e", 5.0, share=0.3)], 0.0, config,
                       PackingFakeCosts(), 4)
    assert sorted(ids(plan)) == [["a", "b"], ["e"]]
