"""Round inputs and the config reject what the solver could not make sense of."""

from __future__ import annotations

import math

import pytest

from stepserve.policies.genserve import GenServeConfig, ImageRequest, RoundInput, VideoJob, VideoStatus
from stepserve.policies.types import ShapeKey

from tests.cpu.policies.genserve.fakes import SMALL, img, vid, workers


def test_running_video_needs_workers_and_only_it_has_them():
    with pytest.raises(ValueError, match="running job has workers"):
        VideoJob("v", "wan", 480, 832, 81, 10, 100.0, 0.0, VideoStatus.RUNNING, ())
    with pytest.raises(ValueError, match="running job has workers"):
        VideoJob("v", "wan", 480, 832, 81, 10, 100.0, 0.0, VideoStatus.PAUSED, ("w0",))
    with pytest.raises(ValueError, match="repeated worker"):
        vid("v", 100.0, on=("w0", "w0"))


@pytest.mark.parametrize("field,value", [("steps_left", 0), ("rows", 0), ("rows", True), ("deadline", math.nan)])
def test_image_fields_are_checked(field, value):
    kwargs = dict(request_id="i", shape_key=SMALL, rows=2, steps_left=10, deadline=5.0, arrival_time=0.0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        ImageRequest(**kwargs)


def test_an_image_is_one_frame_and_a_video_has_positive_rows():
    with pytest.raises(ValueError, match="one frame"):
        img("i", 5.0, key=ShapeKey("wan", 480, 832, 81))
    assert vid("v", 100.0).rows == 2  # CFG unless told otherwise
    assert vid("v", 100.0, rows=1).rows == 1
    with pytest.raises(ValueError, match="rows"):
        vid("v", 100.0, rows=0)


def test_infinite_deadline_means_no_slo():
    assert img("i", math.inf).deadline == math.inf


@pytest.mark.parametrize("kwargs,match", [
    (dict(sp_degrees=()), "non-empty"),
    (dict(sp_degrees=(2, 1)), "strictly increasing"),
    (dict(sp_degrees=(1, 1, 2)), "strictly increasing"),
    (dict(sp_degrees=(0, 1)), "positive"),
    (dict(image_max_batch=0), "image_max_batch"),
    (dict(round_s=-1.0), "round_s"),
    (dict(fixed_sp_degree=3), "fixed_sp_degree"),
    (dict(resume_degree=3), "resume_degree"),
])
def test_config_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenServeConfig(**kwargs)


def test_round_rejects_inconsistent_snapshots():
    ws = workers(4)
    with pytest.raises(ValueError, match="repeated worker id"):
        RoundInput(0.0, ("w0", "w0"))
    with pytest.raises(ValueError, match="unknown worker"):
        RoundInput(0.0, ws, videos=(vid("v", 10.0, on=("w9",)),))
    with pytest.raises(ValueError, match="SP groups of both"):
        RoundInput(0.0, ws, videos=(vid("a", 10.0, on=("w0", "w1")), vid("b", 10.0, on=("w1",))))
    with pytest.raises(ValueError, match="unknown worker"):
        RoundInput(0.0, ws, images=(img("i", 1.0, worker="w7"),))
    with pytest.raises(ValueError, match="unique"):
        RoundInput(0.0, ws, images=(img("x", 1.0),), videos=(vid("x", 10.0),))


def test_round_busy_workers_must_be_known():
    ws = workers(2)
    assert RoundInput(0.0, ws, busy=frozenset({"w1"})).busy == {"w1"}
    with pytest.raises(ValueError, match="busy"):
        RoundInput(0.0, ws, busy=frozenset({"w9"}))
    with pytest.raises(ValueError, match="busy"):
        RoundInput(0.0, ws, busy={"w1"})  # a plain set: mutable, and not hashable with the round
