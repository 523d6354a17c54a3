"""VAE chunking: every partition of a real diffusers AutoencoderKL decode is bit-equal to
`vae.decode`, balanced, and refuses what it does not replay."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from diffusers import AsymmetricAutoencoderKL, AutoencoderKL
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from stepserve.engine.vae_chunking import ChunkedDecode, balanced_partition, chunk_plan
from stepserve.runtime import CONFIGS

# 8x downscale, as SD1.5/SDXL/SD3/Flux; 16 -> 8 channels in the last up block gives a shortcut conv.
BASE = dict(block_out_channels=(8, 16, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=4,
            latent_channels=4, sample_size=64)
VARIANTS = {
    "sd": {},
    "bare": dict(use_post_quant_conv=False, mid_block_add_attention=False),
    "sd3": dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                scaling_factor=1.5305, shift_factor=0.0609),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds barrier waits, which cost
    seconds per decode when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_vae(seed: int = 0, **config) -> AutoencoderKL:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**{**BASE, **config}).eval()


def latents(vae: AutoencoderKL, batch: int = 1, height: int = 8, width: int = 8, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.latent_channels, height, width, generator=generator, dtype=vae.dtype)


def reference(vae: AutoencoderKL, z: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return vae.decode(z, return_dict=False)[0]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_vae(request) -> AutoencoderKL:
    return tiny_vae(**VARIANTS[request.param])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_chunking_is_bit_equal_to_decode(variant_vae, dtype):
    vae = copy.deepcopy(variant_vae).to(dtype)
    z = latents(vae, height=4, width=4)  # a 32 px image: bfloat16 convolutions are slow on CPU
    expected = reference(vae, z)
    units = len(chunk_plan(vae, z.shape, 1).units)
    for chunks in range(1, units + 1):
        with torch.inference_mode():
            decode = ChunkedDecode(vae, z, chunks)
            for index in range(chunks):
                assert (decode.chunk_index, decode.done) == (index, False)
                decode.step()
        assert (decode.chunk_index, decode.done, decode.chunks) == (chunks, True, chunks)
        assert decode.result.dtype == dtype
        assert torch.equal(decode.result, expected), f"{chunks} chunks"


def test_batch_non_square_latents_and_grad_mode_match_decode():
    vae = tiny_vae()
    z = latents(vae, batch=2, height=6, width=10)
    expected = reference(vae, z)
    for chunks in (1, 4, len(chunk_plan(vae, z.shape, 1).units)):
        with torch.inference_mode():
            assert torch.equal(ChunkedDecode(vae, z, chunks).run(), expected)
    with torch.no_grad():
        assert torch.equal(ChunkedDecode(vae, z, 3).run(), expected)
    decoded = ChunkedDecode(vae, z, 5).run()  # grad enabled, as the caller left it
    assert decoded.requires_grad and torch.equal(decoded.detach(), expected)
    vae.enable_gradient_checkpointing()  # changes what a backward recomputes, not the values
    assert torch.equal(vae.decode(z, return_dict=False)[0].detach(), expected)
    assert torch.equal(ChunkedDecode(vae, z, 5).run().detach(), expected)


def test_force_upcast_is_irrelevant_to_decode():
    upcast, plain = tiny_vae(**VARIANTS["sd3"], force_upcast=True), tiny_vae(**VARIANTS["sd3"], force_upcast=False)
    z = latents(plain)
    with torch.inference_mode():
        assert torch.equal(ChunkedDecode(upcast, z, 4).run(), reference(plain, z))


def test_plan_is_contiguous_complete_and_balanced(variant_vae):
    z = latents(variant_vae, batch=2)
    units = chunk_plan(variant_vae, z.shape, 1).units
    assert len(set(units)) == len(units)
    for chunks in range(1, len(units) + 1):
        plan = chunk_plan(variant_vae, z.shape, chunks)
        assert plan.units == units and plan.chunks == chunks == len(plan.sizes)
        assert all(size >= 1 for size in plan.sizes) and sum(plan.sizes) == len(units)
        total = sum(plan.unit_costs)
        assert sum(plan.chunk_costs) == total
        assert max(plan.chunk_costs) <= total / chunks + max(plan.unit_costs)
        assert ChunkedDecode(variant_vae, z, chunks).plan == plan


def test_partition_matches_brute_force():
    rng = random.Random(3)
    for _ in range(60):
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
        for chunks in range(1, len(costs) + 1):
            sizes = balanced_partition(costs, chunks)
            assert len(sizes) == chunks and min(sizes) >= 1 and sum(sizes) == len(costs)
            assert _largest_run(costs, sizes) == min(
                _largest_run(costs, (b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))))
                for cuts in itertools.combinations(range(1, len(costs)), chunks - 1))


def _largest_run(costs, sizes) -> int:
    bounds = list(itertools.accumulate(sizes, initial=0))
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_unit_costs_are_the_multiply_accumulates_torch_counts(variant_vae):
    z = latents(variant_vae, batch=2, height=4, width=6)
    plan = chunk_plan(variant_vae, z.shape, 1)
    decode = ChunkedDecode(variant_vae, z, len(plan.units))  # one unit per step
    # the math backend spells attention as matmuls, which the counter sees (the CPU flash kernel it does not)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
        for cost in plan.unit_costs:
            with FlopCounterMode(display=False) as counter:
                decode.step()
            assert counter.get_total_flops() == 2 * cost


def test_refusals():
    vae = tiny_vae()
    z = latents(vae)
    units = len(chunk_plan(vae, z.shape, 1).units)
    for chunks in (0, units + 1):
        with pytest.raises(ValueError, match="chunks"):
            chunk_plan(vae, z.shape, chunks)
        with pytest.raises(ValueError, match="chunks"):
            ChunkedDecode(vae, z, chunks)
    with pytest.raises(ValueError, match="latents"):
        ChunkedDecode(vae, torch.zeros(1, 16, 8, 8), 2)
    for enable in (vae.enable_tiling, vae.enable_slicing):
        enable()
        with pytest.raises(ValueError, match="tiling and slicing"):
            ChunkedDecode(vae, z, 2)
        vae.disable_tiling()
        vae.disable_slicing()
    hook = vae.decoder.mid_block.register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(ValueError, match="hooks"):
        ChunkedDecode(vae, z, 2)
    hook.remove()
    asymmetric = AsymmetricAutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2, down_block_out_channels=(8, 16), layers_per_down_block=1,
        up_block_types=("UpDecoderBlock2D",) * 2, up_block_out_channels=(8, 16), layers_per_up_block=1,
        norm_num_groups=4, latent_channels=4)
    with pytest.raises(ValueError, match="AsymmetricAutoencoderKL"):
        ChunkedDecode(asymmetric, z, 2)
    attention_up = tiny_vae(up_block_types=("UpDecoderBlock2D",) * 2 + ("AttnUpDecoderBlock2D", "UpDecoderBlock2D"))
    with pytest.raises(ValueError, match="AttnUpDecoderBlock2D"):
        ChunkedDecode(attention_up, z, 2)


def test_result_and_step_outside_the_decode_raise():
    vae = tiny_vae()
    decode = ChunkedDecode(vae, latents(vae), 2)
    with pytest.raises(RuntimeError, match="not finished"):
        decode.result
    decode.step()
    with pytest.raises(RuntimeError, match="1 of 2"):
        decode.result
    decode.step()
    with pytest.raises(RuntimeError, match="already finished"):
        decode.step()


def test_shipped_shapes_vae_is_bit_equal():
    vae = AutoencoderKL.from_pretrained(CONFIGS / "models" / "shapes" / "sd" / "vae", use_safetensors=True).eval()
    side = vae.config.sample_size // 2 ** (len(vae.config.block_out_channels) - 1)
    z = latents(vae, height=side, width=side)
    expected = reference(vae, z)
    for chunks in range(1, 5):
        with torch.inference_mode():
            assert torch.equal(ChunkedDecode(vae, z, chunks).run(), expected), f"{chunks} chunks"
