"""Masked edits on CUDA (`python -m pytest tests/gpu -m gpu` on a GPU machine): an exact edit in
a mixed batch equals the SD3 inpaint pipeline on the GPU, and the masked forward with a record of
its own inputs equals the plain one there."""

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel

from stepserve.actors.activation_cache import ActivationCache
from stepserve.engine.editing.block_loader import BlockLoader, pin
from stepserve.engine.editing.masked_sd3 import (
    CacheKind, MaskedPlan, SD3Inputs, masked_forward, recording_forward, token_index,
)
from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.families.sd3 import TINY
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import StepRunner
from stepserve.engine.template_edits import TemplateCache

from tests.cpu.engine.editing.test_block_loader import USE, _index, _inputs
from tests.cpu.engine.test_edit_golden import edit_admission, edit_spec, pipeline_latents
from tests.cpu.engine.test_template_edits import run, templated

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_sd3():
    assert torch.cuda.is_available(), "the gpu suite needs a CUDA device"
    return load_family(ModelSource(name="tiny-sd3", family="sd3", preset="tiny"), ALL_PARTS, "cuda")


def test_an_edit_in_a_mixed_batch_equals_the_inpaint_pipeline_on_cuda(cuda_sd3):
    runner = StepRunner("gpu0", {"tiny-sd3": cuda_sd3})
    edit, edit_in = edit_spec(cuda_sd3, "e", strength=0.7, seed=4)
    other, other_in = edit_spec(cuda_sd3, "o", seed=5, box=(0, 0, 64, 32))
    got = run(runner, cuda_sd3, [(edit, edit_in), (other, other_in)])
    # cuBLAS picks other kernels for the batch's 4 rows than for the pipeline's 2: float32 sums in
    # another order, ~1e-3 apart after the steps (on the CPU the two are equal to 1e-5).
    np.testing.assert_allclose(got["e"], pipeline_latents(cuda_sd3, edit, edit_in), atol=5e-3, rtol=1e-2)
    assert edit_admission(cuda_sd3, edit, edit_in).conditioning.edit is not None


def test_masked_forward_with_its_own_record_equals_plain_on_cuda(cuda_sd3):
    transformer = cuda_sd3.denoiser
    g = torch.Generator("cpu").manual_seed(0)
    inputs = SD3Inputs(torch.randn(2, 16, 16, 16, generator=g).cuda(), torch.randn(2, 20, 64, generator=g).cuda(),
                       torch.randn(2, 64, generator=g).cuda(), torch.tensor([500.0, 500.0], device="cuda"))
    plain, record = recording_forward(transformer, inputs)
    mask = torch.zeros(2, 1, 16, 16, device="cuda")
    mask[:, :, 4:10, 2:8] = 1
    host = [r.cpu().pin_memory() for r in record]
    plan = MaskedPlan(token_index(mask, 2), lambda b: host[b].to("cuda", non_blocking=True), [True] * len(host))
    torch.testing.assert_close(masked_forward(transformer, inputs, plan), plain, atol=1e-4, rtol=1e-3)


def test_template_edits_record_and_reuse_on_cuda(cuda_sd3):
    runner = StepRunner("gpu0", {"tiny-sd3": cuda_sd3},
                        modes=ModeSettings(templates=TemplateCache(ActivationCache(memory_bytes=256 << 20),
                                                                   CacheKind.KEYS_VALUES)))
    first, first_in = edit_spec(cuda_sd3, "a", seed=1)
    recorded = run(runner, cuda_sd3, [(templated(first), first_in)])["a"]
    again = run(runner, cuda_sd3, [(templated(first.__class__(**{**first.__dict__, "request_id": "b"})), first_in)])
    np.testing.assert_allclose(again["b"], recorded, atol=1e-4, rtol=1e-3)


def test_cuda_loads_equal_the_host_tensors_and_the_forward():
    """`BlockLoader` on CUDA: the side stream's copies, pinned or pageable, pipelined or naive,
    give the forward with the record already on the device."""
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**{**TINY["transformer"], "num_layers": len(USE)}).eval().to("cuda")
    inputs, index = _inputs(model, "cuda"), _index("cuda")
    _, on_device = recording_forward(model, inputs)
    expected = masked_forward(model, inputs, MaskedPlan(index, on_device, USE))
    pinned = pin(dict(enumerate(on_device)))
    assert all(t.is_pinned() for t in pinned.values()) and pin(pinned)[0] is pinned[0]
    pageable = [t.cpu() for t in on_device]
    for host in (pinned, pageable):
        for naive in (False, True):
            loader = BlockLoader(lambda b: host[b], USE, "cuda", naive)
            out = masked_forward(model, inputs, MaskedPlan(index, loader, USE))
            torch.testing.assert_close(out, expected)
    parts = BlockLoader(lambda b: [pinned[b][:1], pinned[b][1:]], USE, "cuda")(0)
    torch.testing.assert_close(parts, on_device[0], atol=0, rtol=0)  # a copy: bit for bit
