"""SynerDiff's VAE chunking on a worker (`engine.decode_lane`): a finished image decodes one chunk
a denoising round, in the thread that waits for it, and its PNG is the whole decode's."""

import threading
import time

import numpy as np
import pytest
import torch

from stepserve.engine.decode_lane import DecodeLane, PendingDecode
from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, run_together
from tests.tiny_video import TINY_WAN


@pytest.mark.parametrize("name", ["tiny_family", "tiny_sd3"])
def test_a_family_decodes_in_chunks_what_it_decodes_whole(name, request):
    family = request.getfixturevalue(name)
    latents = torch.randn(1, family.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = family.decode(latents)
        for chunks in (1, 2, 5):
            np.testing.assert_array_equal(family.decoded_pixels(family.decode_in_chunks(latents, chunks).run()), whole)


def test_videos_do_not_decode_in_chunks():
    wan = load_family(TINY_WAN, (DENOISER,), "cpu")
    with pytest.raises(ValueError, match="cannot decode in chunks"):
        wan.decode_in_chunks(torch.zeros(1, 4, 1, 4, 4), 2)


def test_a_finished_image_leaves_decoding_and_its_png_is_the_whole_decodes(tiny_family):
    specs = [make_spec("a", steps=3, seed=1), make_spec("b", steps=3, seed=2, prompt="a lighthouse")]
    lane = DecodeLane(chunks=4, idle_s=0.0)
    pending, _ = run_together(StepRunner("w0", {"tiny-sd": tiny_family}, decode_images=True, decode_lane=lane),
                              tiny_family, specs, 3)
    assert pending == {"a": PendingDecode("a"), "b": PendingDecode("b")}
    assert lane.pending == ("a", "b")
    whole, _ = run_together(StepRunner("w1", {"tiny-sd": tiny_family}, decode_images=True), tiny_family, specs, 3)
    assert lane.wait("b") == whole["b"] and lane.wait("a") == whole["a"]
    assert lane.pending == ()
    with pytest.raises(KeyError, match="not decoding"):
        lane.wait("a")


def test_a_decode_runs_one_chunk_a_round_beside_the_steps(tiny_family):
    lane = DecodeLane(chunks=3, idle_s=60.0)  # never idle here: only rounds move it
    runner = StepRunner("w0", {"tiny-sd": tiny_family}, decode_images=True, decode_lane=lane)
    short, long = make_spec("short", steps=1, seed=1), make_spec("long", steps=5, seed=2)
    admissions = {s.request_id: admission_for(tiny_family, s) for s in (short, long)}
    _, payloads = runner.execute(WorkerPlan("w0", admit=("short", "long"), groups=(StepGroup(("short", "long")),),
                                            finish=("short",), plan_id=0), admissions)
    assert payloads == [PendingDecode("short")]
    job = lane._pending["short"][1]
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(lane.wait("short", timeout_s=60)))
    waiter.start()
    for round_ in range(1, 4):
        time.sleep(0.2)
        assert job.chunk_index == round_ - 1  # nothing runs between rounds
        runner.execute(WorkerPlan("w0", groups=(StepGroup(("long",)),), plan_id=round_), {})
        deadline = time.monotonic() + 30
        while job.chunk_index < round_ and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.chunk_index == round_
    waiter.join(30)
    assert got and got[0].startswith(b"\x89PNG")


def test_with_no_rounds_the_waiter_decodes_by_itself(tiny_family):
    lane = DecodeLane(chunks=3, idle_s=0.01)
    lane.start("r", tiny_family, torch.randn(1, 4, 8, 8))
    assert lane.wait("r", timeout_s=60).startswith(b"\x89PNG")


def test_a_failing_decode_fails_its_request_only(tiny_family):
    class Broken:  # a family whose post-processing fails: the lane must report it, and go on
        def decode_in_chunks(self, latents, chunks):
            return tiny_family.decode_in_chunks(latents, chunks)

        def decoded_pixels(self, image):
            raise RuntimeError("post-processing broke")

    lane = DecodeLane(chunks=2, idle_s=0.0)
    lane.start("bad", Broken(), torch.randn(1, 4, 8, 8))
    lane.start("good", tiny_family, torch.randn(1, 4, 8, 8))
    with pytest.raises(RuntimeError, match="post-processing broke"):
        lane.wait("bad")
    assert lane.wait("good").startswith(b"\x89PNG")


def test_a_lane_needs_images_decoded_on_the_worker(tiny_family):
    with pytest.raises(ValueError, match="decode_images"):
        StepRunner("w0", {"tiny-sd": tiny_family}, decode_lane=DecodeLane(2))
    with pytest.raises(ValueError, match="at least 1 chunk"):
        DecodeLane(0)
