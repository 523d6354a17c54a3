"""SynerDiff's served mechanisms on CUDA (run with `python -m pytest tests/gpu -m gpu` on a GPU
machine): VAE chunking equals the whole decode, the decode lane's chunks (on a CUDA stream of
their own, beside the step runner's forwards) give the whole decode's PNG, and a skip-CFG request
leaves its partners in a mixed batch exact. They mirror the CPU tests of the same features
(tests/cpu/engine/test_vae_chunking.py, test_decode_lane.py, test_skip_cfg.py); their bodies use
only the families' own devices, so the same functions run on the CPU too."""

from __future__ import annotations

import copy
import dataclasses
import io
import threading
import time

import numpy as np
import PIL.Image
import pytest
import torch

from stepserve.engine.decode_lane import DecodeLane, PendingDecode
from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.families.base import cast_module
from stepserve.engine.step_runner import StepRunner
from stepserve.engine.vae_chunking import ChunkedDecode, chunk_plan
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import TINY, TINY_SD3, admission_for, make_spec, run_together, solo_pipeline_image

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FULL = ModelSource(name="sd15-full", family="sd15", preset="full", dtype="float16")
# A chunked decode calls the whole decode's modules on the same tensors in the same stream, so on
# one device it is equal or nearly so; the tolerance only allows for another kernel choice.
DECODE_TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
                    torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _load(source: ModelSource, device: str = DEVICE):
    if device == "cuda":
        assert torch.cuda.is_available(), "the gpu suite needs a CUDA device"
    return load_family(source, ALL_PARTS, device)


@pytest.fixture(scope="module")
def cuda_sd():
    return _load(TINY)


@pytest.fixture(scope="module")
def cuda_sd3():
    return _load(TINY_SD3)


@pytest.fixture(scope="module")
def cuda_full():
    """SD1.5 at its published size, random weights, float16 (speed and streams, not pictures)."""
    return _load(FULL)


# ---- VAE chunking --------------------------------------------------------------------------------


def check_chunked_decode(vae, latents: torch.Tensor, counts=None) -> int:
    """`ChunkedDecode(vae, latents, n).run()` against `vae.decode` for each n of `counts` (default:
    every n); the number of units the decoder splits into."""
    units = len(chunk_plan(vae, latents.shape, 1).units)
    with torch.inference_mode():
        expected = vae.decode(latents, return_dict=False)[0]
    assert torch.isfinite(expected).all()
    for chunks in counts or range(1, units + 1):
        with torch.inference_mode():
            decode = ChunkedDecode(vae, latents, chunks)
            for index in range(chunks):
                assert (decode.chunk_index, decode.done) == (index, False)
                decode.step()
        assert (decode.done, decode.chunks) == (True, chunks)
        result = decode.result
        assert (result.dtype, result.device) == (expected.dtype, expected.device)
        torch.testing.assert_close(result, expected, **DECODE_TOLERANCE[vae.dtype], msg=f"{chunks} chunks")
    return units


def _latents(vae, batch: int, side: int, seed: int = 1) -> torch.Tensor:
    z = torch.randn(batch, vae.config.latent_channels, side, side, generator=torch.Generator().manual_seed(seed))
    return z.to(device=vae.device, dtype=vae.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_chunking_of_the_tiny_vae_equals_its_decode(cuda_sd, dtype):
    vae = copy.deepcopy(cuda_sd.vae)
    cast_module(vae, dtype)
    assert check_chunked_decode(vae, _latents(vae, batch=2, side=8)) > 2


def test_chunked_full_size_vae_equals_its_decode_at_512px_in_fp16(cuda_full):
    vae = cuda_full.vae
    assert vae.dtype == torch.float16
    z = _latents(vae, batch=1, side=512 // cuda_full.vae_scale_factor)
    units = len(chunk_plan(vae, z.shape, 1).units)
    check_chunked_decode(vae, z, sorted({1, 2, 3, 5, 8, units}))


# ---- the decode lane -----------------------------------------------------------------------------


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def assert_same_png(got: bytes, expected: bytes) -> None:
    """Equal PNGs, or (another kernel choice moving a value across a rounding edge) pixels at most
    one level apart."""
    assert got.startswith(b"\x89PNG")
    if got != expected:
        assert np.abs(_pixels(got) - _pixels(expected)).max() <= 1


def check_lane_png_is_the_whole_decodes(family, model: str, size: int, steps: int = 3) -> None:
    """Two requests denoised together: with a lane each leaves as a PendingDecode whose PNG is
    the one a whole decode on the worker gives."""
    specs = [make_spec("a", steps=steps, seed=1, size=size, model=model),
             make_spec("b", steps=steps, seed=2, size=size, model=model, prompt="a lighthouse")]
    lane = DecodeLane(chunks=4, idle_s=0.0)
    pending, _ = run_together(StepRunner("w0", {model: family}, decode_images=True, decode_lane=lane),
                              family, specs, steps)
    assert pending == {"a": PendingDecode("a"), "b": PendingDecode("b")}
    assert lane.pending == ("a", "b")
    streams = [stream for _, _, stream in lane._pending.values()]
    assert all((stream is not None) == (family.device.type == "cuda") for stream in streams)
    whole, _ = run_together(StepRunner("w1", {model: family}, decode_images=True), family, specs, steps)
    assert_same_png(lane.wait("b", timeout_s=120), whole["b"])
    assert_same_png(lane.wait("a", timeout_s=120), whole["a"])
    assert lane.pending == ()


def check_lane_runs_a_chunk_a_round_beside_the_steps(family, model: str, size: int, chunks: int = 3) -> None:
    """A finished image decodes one chunk per round in a waiting thread (its own stream on a
    GPU) while the main thread runs the next rounds' forwards; its PNG is the whole decode's."""
    lane = DecodeLane(chunks=chunks, idle_s=60.0)  # never idle here: only rounds move it
    runner = StepRunner("w0", {model: family}, decode_images=True, decode_lane=lane)
    short = make_spec("short", steps=1, seed=1, size=size, model=model)
    long = make_spec("long", steps=chunks + 2, seed=2, size=size, model=model)
    first = WorkerPlan("w0", admit=("short", "long"), groups=(StepGroup(("short", "long")),), finish=("short",),
                       plan_id=0)
    _, payloads = runner.execute(first, {s.request_id: admission_for(family, s) for s in (short, long)})
    assert payloads == [PendingDecode("short")]
    _, job, stream = lane._pending["short"]
    assert (stream is not None) == (family.device.type == "cuda")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(lane.wait("short", timeout_s=120)))
    waiter.start()
    for round_ in range(1, chunks + 1):
        time.sleep(0.2)
        assert job.chunk_index == round_ - 1  # nothing runs between rounds
        runner.execute(WorkerPlan("w0", groups=(StepGroup(("long",)),), plan_id=round_), {})
        deadline = time.monotonic() + 60
        while job.chunk_index < round_ and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.chunk_index == round_
    waiter.join(60)
    assert got, "the waiting thread never got its PNG"
    # the same first round (the same batch, so the same kernels) on a worker that decodes whole
    whole_runner = StepRunner("w1", {model: family}, decode_images=True)
    _, whole = whole_runner.execute(first, {s.request_id: admission_for(family, s) for s in (short, long)})
    assert_same_png(got[0], whole[0])


def test_the_lanes_png_is_the_whole_decodes_on_cuda(cuda_sd):
    check_lane_png_is_the_whole_decodes(cuda_sd, "tiny-sd", 64)


def test_the_lane_decodes_a_chunk_a_round_on_its_stream_on_cuda(cuda_sd):
    check_lane_runs_a_chunk_a_round_beside_the_steps(cuda_sd, "tiny-sd", 64)


def test_the_lane_beside_full_size_fp16_steps_at_512px(cuda_full):
    """Forwards long enough for the lane's stream to overlap them."""
    check_lane_png_is_the_whole_decodes(cuda_full, FULL.name, 512, steps=2)
    check_lane_runs_a_chunk_a_round_beside_the_steps(cuda_full, FULL.name, 512, chunks=4)


# ---- skip-CFG ------------------------------------------------------------------------------------


def check_skip_cfg_partner_is_exact(family, model: str, image_atol: float, steps: int = 6) -> None:
    """A request skipping CFG from half its steps on, in one forward with a plain partner: the
    partner's image is its solo pipeline image, the skipper's is what it gets alone and not the
    guided one. On CUDA cuBLAS / cuDNN may pick other kernels for a batch of 3 rows than for the
    pipeline's 2 (float32 sums in another order): `image_atol` is test_cuda_engine's 1e-3 for
    SD1.5 and, for SD3's transformer, the ~1e-3 spread in latents test_cuda_edits allows for."""
    plain = make_spec("plain", steps=steps, seed=1, model=model)
    late = make_spec("late", steps=steps, seed=2, model=model, prompt="a lighthouse")
    skipping = dataclasses.replace(late, skip_cfg_from=0.5)

    def generate(specs):
        runner = StepRunner("w0", {model: family})
        return run_together(runner, family, specs, steps, (StepGroup(tuple(s.request_id for s in specs)),))

    def image(latents):
        return family.decode(torch.from_numpy(latents))[0]

    together, states = generate([plain, skipping])
    assert states["late"].first_step == steps // 2 and "plain" not in states
    # the partner: exact
    np.testing.assert_allclose(image(together["plain"]), solo_pipeline_image(family, plain), atol=image_atol)
    exact, _ = generate([plain, late])
    np.testing.assert_allclose(together["plain"], exact["plain"], rtol=1e-3, atol=5e-3)
    assert np.abs(together["late"] - exact["late"]).max() > 1e-2  # it skipped: not the guided image
    alone, _ = generate([skipping])
    # As alone, within the batch-size spread: on an H200 cuBLAS picks other float32 kernels for 3
    # rows than for 1, and the skipper's image moved by up to 0.002 (the partner stays within 1e-3).
    np.testing.assert_allclose(image(together["late"]), image(alone["late"]), atol=max(image_atol, 5e-3))


def test_a_skip_cfg_partner_equals_its_solo_pipeline_on_cuda(cuda_sd):
    check_skip_cfg_partner_is_exact(cuda_sd, "tiny-sd", image_atol=1e-3)


def test_a_skip_cfg_partner_equals_its_solo_pipeline_on_cuda_sd3(cuda_sd3):
    check_skip_cfg_partner_is_exact(cuda_sd3, "tiny-sd3", image_atol=5e-3)
