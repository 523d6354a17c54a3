"""`check_decision` rejects plans the router could not execute or that break a switch."""

from __future__ import annotations

import dataclasses

import pytest

from stepserve.policies.genserve import (
    GenServeConfig,
    ImageBatch,
    RoundInput,
    VideoAction,
    VideoDecision,
    check_decision,
    decide_round,
)

from tests.cpu.policies.genserve.fakes import LARGE, SMALL, FakeCosts, img, vid, workers

W4 = workers(4)
INP = RoundInput(0.0, W4, images=(img("a", 5.0, worker="w3"), img("b", 5.0), img("big", 5.0, key=LARGE)),
                 videos=(vid("v", 100.0, on=("w0", "w1")), vid("q", 100.0)))
CONFIG = GenServeConfig(sp_degrees=(1, 2, 4))


def good():
    decision = decide_round(INP, CONFIG, FakeCosts())
    check_decision(INP, CONFIG, decision)
    return decision


def with_videos(decision, **by_id):
    return dataclasses.replace(decision, videos=tuple(by_id.get(v.job_id, v) for v in decision.videos))


def test_the_solver_output_passes():
    good()


@pytest.mark.parametrize("change,match", [
    (dict(v=VideoDecision("v", VideoAction.KEEP, ("w0", "w2"))), "KEEP must keep"),
    (dict(v=VideoDecision("v", VideoAction.RUN, ("w0", "w1"))), "must be KEEP"),
    (dict(q=VideoDecision("q", VideoAction.PAUSE)), "only a running video"),
    (dict(v=VideoDecision("v", VideoAction.WAIT)), "paused, not left waiting"),
    (dict(q=VideoDecision("q", VideoAction.RUN, ("w2", "w3", "w9"))), "not permitted|unknown worker"),
    (dict(v=VideoDecision("v", VideoAction.KEEP, ("w0", "w1")), q=VideoDecision("q", VideoAction.RUN, ("w1",))),
     "given to both"),
    (dict(q=VideoDecision("q", VideoAction.RUN, ())), "with workers"),
])
def test_bad_video_decisions(change, match):
    decision = good()
    # Clear the images so only the video change can be at fault.
    decision = dataclasses.replace(with_videos(decision, **change), image_batches=())
    with pytest.raises(ValueError, match=match):
        check_decision(INP, CONFIG, decision)


def test_pause_with_preemption_off_is_rejected():
    decision = dataclasses.replace(with_videos(good(), v=VideoDecision("v", VideoAction.PAUSE)), image_batches=())
    check_decision(INP, CONFIG, decision)
    with pytest.raises(ValueError, match="preemption off"):
        check_decision(INP, dataclasses.replace(CONFIG, preemption=False), decision)


@pytest.mark.parametrize("batch,match", [
    (ImageBatch("w3", SMALL, ("a", "big"), ("big",), 0.1), "shape key"),
    (ImageBatch("w3", SMALL, ("a", "a"), (), 0.1), "two batches"),
    (ImageBatch("w3", SMALL, ("a", "b"), (), 0.1), "admit"),
    (ImageBatch("w3", SMALL, (), (), 0.1), "0 images"),
])
def test_bad_image_batches(batch, match):
    base = dataclasses.replace(good(), image_batches=())
    base = with_videos(base, v=VideoDecision("v", VideoAction.PAUSE), q=VideoDecision("q", VideoAction.WAIT))
    with pytest.raises(ValueError, match=match):
        check_decision(INP, CONFIG, dataclasses.replace(base, image_batches=(batch,)))
    with pytest.raises(ValueError, match="images"):
        too_many = ImageBatch("w3", SMALL, ("a", "b"), ("b",), 0.1)
        check_decision(INP, dataclasses.replace(CONFIG, image_max_batch=1),
                       dataclasses.replace(base, image_batches=(too_many,)))


def test_a_packed_batch_with_an_edit_of_a_cached_template_is_rejected():
    """A packed forward computes every token (see image_batching: such edits are not packed)."""
    inp = dataclasses.replace(INP, images=(img("a", 5.0, worker="w3"), img("big", 5.0, key=LARGE, share=0.4)),
                              videos=())
    packing = dataclasses.replace(CONFIG, pack_resolutions=True)
    batch = ImageBatch("w3", SMALL, ("a", "big"), ("big",), 0.1)
    with pytest.raises(ValueError, match="packed forward computes every token"):
        check_decision(inp, packing, dataclasses.replace(good(), videos=(), image_batches=(batch,)))
    plain = dataclasses.replace(inp, images=(inp.images[0], img("big", 5.0, key=LARGE)))
    check_decision(plain, packing, dataclasses.replace(good(), videos=(), image_batches=(batch,)))
