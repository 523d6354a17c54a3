"""The Triton patch-stitch kernels against their torch reference on CUDA, and the patched UNet
forward on CUDA (run with `python -m pytest tests/gpu -m gpu` on a GPU machine with Triton)."""

import pytest
import torch

from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.patched import PatchLayout, patched_unet_forward
from stepserve.kernels import patch_stitch
from stepserve.kernels.patch_stitch import group_norm_stitch, reference_group_norm_stitch, stitch_halo

from tests.tiny import TINY

pytestmark = pytest.mark.gpu

# Padded planes of 34x34 (more than one 1024-cell block) and groups of 2 x 32 x 32 elements.
LAYOUT = PatchLayout.of([(64, 96), (32, 32), (96, 32)], 32)


@pytest.fixture(autouse=True, scope="module")
def triton_on_cuda():
    assert torch.cuda.is_available(), "the gpu suite needs a CUDA device"
    assert patch_stitch.triton is not None, "the gpu suite needs Triton"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("per_image", [True, False])
def test_triton_group_norm_stitch_matches_reference(dtype, tol, per_image):
    g = torch.Generator("cuda").manual_seed(0)
    x = (torch.randn(LAYOUT.num_patches, 64, 32, 32, generator=g, device="cuda") * 3 + 1).to(dtype)
    neighbours = torch.tensor(LAYOUT.neighbours(), device="cuda")
    owner = torch.tensor(LAYOUT.image_of(), device="cuda") if per_image else None
    weight = torch.randn(64, generator=g, device="cuda").to(dtype)
    bias = torch.randn(64, generator=g, device="cuda").to(dtype)
    got = group_norm_stitch(x, neighbours, 32, weight, bias, 1e-5, owner)
    expected = reference_group_norm_stitch(x, neighbours, 32, weight, bias, 1e-5, owner)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(stitch_halo(x, neighbours), patch_stitch.reference_stitch_halo(x, neighbours),
                               atol=0, rtol=0)


@torch.inference_mode()
def test_patched_unet_forward_on_cuda_equals_unpatched():
    unet = load_family(TINY, {DENOISER}, "cuda").denoiser
    g = torch.Generator("cuda").manual_seed(1)
    samples = [torch.randn(2, 4, 16, 16, generator=g, device="cuda"),
               torch.randn(1, 4, 24, 24, generator=g, device="cuda")]
    timesteps = torch.tensor([999.0, 999.0, 10.0], device="cuda")
    context = torch.randn(3, 7, unet.config.cross_attention_dim, generator=g, device="cuda")
    patched = patched_unet_forward(unet, samples, timesteps, context)
    for got, s, rows in zip(patched, samples, (slice(0, 2), slice(2, 3))):
        expected = unet(s, timesteps[rows], encoder_hidden_states=context[rows]).sample
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
