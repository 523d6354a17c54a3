"""The patched UNet forward (tiny SD1.5 and SDXL UNets, real diffusers classes): latents of
different sizes share one forward over their patches and each equals its own unpatched forward
(golden: per-image GroupNorm statistics and halo exchange are exact); per-patch statistics are
PatchedServe's approximation and differ."""

import pytest
import torch
from diffusers import UNet2DConditionModel

from stepserve.engine.addons import LoraRows
from stepserve.engine.addons.lora import LoraLayer, LoraWeights, lora_rows
from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.families.sd15 import TINY as SD15_TINY
from stepserve.engine.patched import NormStats, PatchLayout, patch_multiple, patched_unet_forward

from tests.tiny import TINY, TINY_SDXL

ATOL = 2e-5  # fp32 CPU: only the GroupNorm reduction order and GEMM blocking change


@pytest.fixture(scope="module", params=["sd15", "sdxl"])
def unet(request):
    source = TINY if request.param == "sd15" else TINY_SDXL
    return load_family(source, {DENOISER}, "cpu").denoiser


def _inputs(unet, sizes, seed=0):
    """One sample per (rows, height, width), and per-row timesteps and conditioning."""
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randn(n, 4, h, w, generator=g) for n, h, w in sizes]
    rows = sum(n for n, _, _ in sizes)
    timesteps = torch.randint(0, 1000, (rows,), generator=g).float()
    context = torch.randn(rows, 7, unet.config.cross_attention_dim, generator=g)
    added = None
    if unet.config.addition_embed_type == "text_time":
        pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        added = {"text_embeds": torch.randn(rows, pooled, generator=g),
                 "time_ids": torch.randint(0, 1024, (rows, 6), generator=g).float()}
    return samples, timesteps, context, added


def _unpatched(unet, samples, timesteps, context, added):
    outs, first = [], 0
    for s in samples:
        rows = slice(first, first + s.shape[0])
        extra = {} if added is None else {"added_cond_kwargs": {k: v[rows] for k, v in added.items()}}
        outs.append(unet(s, timesteps[rows], encoder_hidden_states=context[rows], **extra).sample)
        first = rows.stop
    return outs


# A CFG-like pair at 16x16, a 24x24 image and a non-square 16x24 one: GCD patch 8.
MIXED = [(2, 16, 16), (1, 24, 24), (1, 16, 24)]


@pytest.mark.parametrize("patch", [None, 4, 2])
@torch.inference_mode()
def test_mixed_resolutions_in_one_patched_forward_equal_each_unpatched_forward(unet, patch):
    samples, timesteps, context, added = _inputs(unet, MIXED)
    patched = patched_unet_forward(unet, samples, timesteps, context, added, patch=patch)
    for got, expected in zip(patched, _unpatched(unet, samples, timesteps, context, added)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_all_patches_go_through_one_forward(unet):
    samples, timesteps, context, added = _inputs(unet, MIXED)
    seen = []
    handle = unet.conv_in.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    try:
        patched_unet_forward(unet, samples, timesteps, context, added)
    finally:
        handle.remove()
    patches = PatchLayout.of([(16, 16)] * 2 + [(24, 24), (16, 24)], 8).num_patches
    assert seen == [(patches, 4, 10, 10)]  # 4 + 4 + 9 + 6 patches of 8x8, with their halos


@torch.inference_mode()
def test_per_patch_statistics_differ_from_the_unpatched_forward(unet):
    samples, timesteps, context, added = _inputs(unet, MIXED)
    approximate = patched_unet_forward(unet, samples, timesteps, context, added, patch=4, stats=NormStats.PATCH)
    error = max((a - e).abs().max().item()
                for a, e in zip(approximate, _unpatched(unet, samples, timesteps, context, added)))
    assert error > 1e-2


@torch.inference_mode()
def test_per_patch_statistics_with_one_patch_per_image_are_exact(unet):
    samples, timesteps, context, added = _inputs(unet, [(2, 16, 16), (1, 16, 16)])
    patched = patched_unet_forward(unet, samples, timesteps, context, added, stats=NormStats.PATCH)
    for got, expected in zip(patched, _unpatched(unet, samples, timesteps, context, added)):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_the_unet_is_put_back_after_a_forward_and_after_an_error(unet):
    modules = dict(unet.named_modules())
    paddings = {name: m.padding for name, m in modules.items() if isinstance(m, torch.nn.Conv2d)}
    samples, timesteps, context, added = _inputs(unet, MIXED)
    before = _unpatched(unet, samples, timesteps, context, added)
    patched_unet_forward(unet, samples, timesteps, context, added)
    with pytest.raises(RuntimeError):  # a context of the wrong width fails inside the forward
        patched_unet_forward(unet, samples, timesteps, context[..., :3], added)
    assert dict(unet.named_modules()) == modules
    assert {name: m.padding for name, m in unet.named_modules() if isinstance(m, torch.nn.Conv2d)} == paddings
    for got, expected in zip(_unpatched(unet, samples, timesteps, context, added), before):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@torch.inference_mode()
def test_forward_hooks_on_patched_convolutions_stay_exact(unet):
    """Per-row LoRAs are forward hooks that convolve the layer's input with the layer's padding: the
    stand-ins call the original convolutions, now padding 0 on halo'd input, so a LoRA on a 3x3
    convolution (and on attention, all rows) adds the same update as unpatched."""
    g = torch.Generator().manual_seed(5)
    conv = unet.down_blocks[0].resnets[0].conv1
    to_q = unet.mid_block.attentions[0].transformer_blocks[0].attn1.to_q
    layers = {
        "down_blocks.0.resnets.0.conv1": LoraLayer(torch.randn(2, conv.in_channels, 3, 3, generator=g),
                                                   torch.randn(conv.out_channels, 2, 1, 1, generator=g), 0.5),
        "mid_block.attentions.0.transformer_blocks.0.attn1.to_q": LoraLayer(
            torch.randn(2, to_q.in_features, generator=g), torch.randn(to_q.out_features, 2, generator=g), 0.5),
    }
    loras = {"l": LoraWeights("l", layers)}
    samples, timesteps, context, added = _inputs(unet, MIXED)
    patches = PatchLayout.of([(16, 16)] * 2 + [(24, 24), (16, 24)], 8).num_patches
    with lora_rows(unet, loras, [LoraRows("l", slice(0, patches), 1.0)], batch=patches):
        patched = patched_unet_forward(unet, samples, timesteps, context, added)
    expected = []
    for s, rows in zip(samples, ([0, 1], [2], [3])):
        with lora_rows(unet, loras, [LoraRows("l", slice(0, len(rows)), 1.0)], batch=len(rows)):
            expected += _unpatched(unet, [s], timesteps[rows], context[rows],
                                   None if added is None else {k: v[rows] for k, v in added.items()})
    plain = _unpatched(unet, samples, timesteps, context, added)
    assert (expected[0] - plain[0]).abs().max() > 1e-3  # the LoRA changes the output
    for got, want in zip(patched, expected):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_patch_multiple_is_two_per_downsampler(unet):
    assert patch_multiple(unet) == 2  # two blocks: one downsampler


def _tiny_sd15_unet(**overrides):
    torch.manual_seed(0)
    return UNet2DConditionModel(in_channels=4, out_channels=4, **{**SD15_TINY["unet"], **overrides}).eval()


@pytest.mark.parametrize("make", [
    lambda: _tiny_sd15_unet(resnet_time_scale_shift="scale_shift"),  # shift makes the zero halo non-zero
    lambda: _tiny_sd15_unet(downsample_padding=0),  # pads only right and bottom
    lambda: _tiny_sd15_unet(down_block_types=("SimpleCrossAttnDownBlock2D", "DownBlock2D")),
])
@torch.inference_mode()
def test_unets_not_known_to_be_exact_are_refused(make):
    unet = make()
    samples, timesteps, context, added = _inputs(unet, MIXED)
    with pytest.raises(ValueError, match="patched forward"):
        patched_unet_forward(unet, samples, timesteps, context, added)


@torch.inference_mode()
def test_unpatchable_sizes_missing_rows_and_freeu_are_refused():
    unet = _tiny_sd15_unet()
    samples, timesteps, context, _ = _inputs(unet, [(1, 6, 6), (1, 9, 9)])  # GCD 3, odd
    with pytest.raises(ValueError, match="not a multiple of 2"):
        patched_unet_forward(unet, samples, timesteps, context)
    samples, timesteps, context, _ = _inputs(unet, MIXED)
    with pytest.raises(ValueError, match="timesteps has 3 rows for 4"):
        patched_unet_forward(unet, samples, timesteps[:3], context)
    unet.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    samples, timesteps, context, _ = _inputs(unet, MIXED)
    with pytest.raises(ValueError, match="FreeU"):
        patched_unet_forward(unet, samples, timesteps, context)
