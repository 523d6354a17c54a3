"""The video runner alone (SP=1): a video paused to host memory and resumed, here or on another
runner, equals an uninterrupted one; decode gives uint8 frames; misuse is a clear error."""

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from stepserve.engine.families import ALL_PARTS, DENOISER, load_family
from stepserve.engine.video_runner import PAUSED, VideoProgress, VideoRunner

from ...tiny_video import TINY_WAN, make_video_spec, run_video, video_conditioning

SPEC = dict(rid="job", steps=4, seed=21, guidance=5.0, frames=5, negative="blurry")


@pytest.fixture(scope="module")
def wan():
    return load_family(TINY_WAN, ALL_PARTS, "cpu")


@pytest.fixture(scope="module")
def uninterrupted(wan):
    spec = make_video_spec(**SPEC)
    return run_video(wan, spec, video_conditioning(wan, spec)).latents


def runner(wan, worker_id="w0"):
    return VideoRunner(worker_id, {TINY_WAN.name: wan})


def test_start_and_step_report_progress(wan):
    spec = make_video_spec(**SPEC)
    r = runner(wan)
    started = r.start(spec, video_conditioning(wan, spec))
    assert (started.job_id, started.steps_done, started.steps_total, started.done) == ("job", 0, 4, False)
    assert r.resident == ("job",)
    stepped = r.step("job")
    assert isinstance(stepped, VideoProgress) and stepped.steps_done == 1 and stepped.duration_s > 0


def test_pause_resume_elsewhere_equals_uninterrupted(wan, uninterrupted):
    spec = make_video_spec(**SPEC)
    first, second = runner(wan, "w0"), runner(load_family(TINY_WAN, {DENOISER}, "cpu"), "w1")
    first.start(spec, video_conditioning(wan, spec))
    for _ in range(2):
        first.step("job")
    state = pickle.loads(pickle.dumps(first.export("job")))  # as it crosses processes
    assert first.resident == ()
    paused = state[PAUSED]
    assert (paused.job_id, paused.steps_done, paused.steps_total) == ("job", 2, 4) and paused.duration_s >= 0
    resumed = second.import_state(state)
    assert (resumed.steps_done, resumed.steps_total) == (2, 4) and second.resident == ("job",)
    while not second.step("job").done:
        pass
    assert torch.equal(second.export("job")["latents"], uninterrupted)


def test_decode_gives_uint8_frames_and_frees_the_video(wan, uninterrupted):
    spec = make_video_spec(**SPEC)
    r = runner(wan)
    r.start(spec, video_conditioning(wan, spec))
    for _ in range(4):
        r.step("job")
    frames = r.decode("job")
    assert frames.shape == (5, 64, 64, 3) and frames.dtype == np.uint8
    expected = (wan.decode(uninterrupted)[0] * 255).round().astype(np.uint8)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 1
    assert r.resident == ()


def test_misuse_is_a_clear_error(wan):
    spec = make_video_spec(**SPEC)
    cond = video_conditioning(wan, spec)
    r = runner(wan)
    for call in (r.step, r.export, r.decode):
        with pytest.raises(KeyError, match="not resident on worker w0"):
            call("nope")
    r.drop("nope")  # dropping is idempotent
    r.start(spec, cond)
    with pytest.raises(ValueError, match="already resident"):
        r.start(spec, cond)
    with pytest.raises(ValueError, match="steps left"):
        r.decode("job")
    state = r.export("job")
    r.import_state(state)
    with pytest.raises(ValueError, match="already resident"):
        r.import_state(state)
    other_model = dataclasses.replace(spec, request_id="other", model="big-wan")
    with pytest.raises(ValueError, match="'big-wan' is not loaded on worker w0"):
        r.start(other_model, cond)
    assert r.resident == ("job",)


def test_decode_without_a_vae_is_refused(wan):
    spec = make_video_spec(**{**SPEC, "steps": 1})
    r = runner(load_family(TINY_WAN, {DENOISER}, "cpu"))
    r.start(spec, video_conditioning(wan, spec))
    r.step("job")
    with pytest.raises(ValueError, match="no VAE loaded"):
        r.decode("job")
    assert r.resident == ("job",)  # still there, for a worker that has one
