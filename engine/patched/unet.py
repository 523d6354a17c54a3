"""One UNet2DConditionModel forward over latents of different sizes (PatchedServe §4): each is cut
into square patches, the UNet's own forward runs over the batch of patches with its spatial
modules swapped for patch-aware stand-ins (`modules`), and the outputs are put back together.

With per-image GroupNorm statistics (the default) every operator computes what it computes on
the whole image: convolutions see their neighbours' edges (zero at the image border, as their own
padding), stride-2 downsampler convolutions too (patch offsets are even at every level), nearest
upsampling and 1x1 convolutions are per pixel, skip connections pair patches of one layout, and
attention runs over whole images. So the result equals each image's unpatched forward up to float
rounding. Per-patch statistics (`NormStats.PATCH`) reproduce the paper's approximation.

Only what has been checked to be exact is accepted: SD1.5/SDXL blocks (CrossAttn/plain Down and
Up blocks, the cross-attention mid block), ResnetBlock2D without its own up/downsampling or
scale-shift time norm, 3x3 convolutions with zero padding 1; anything else is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from diffusers import Transformer2DModel, UNet2DConditionModel
from diffusers.models.attention_processor import Attention
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.unets.unet_2d_blocks import (
    CrossAttnDownBlock2D, CrossAttnUpBlock2D, DownBlock2D, UNetMidBlock2DCrossAttn, UpBlock2D,
)
from torch import nn

from stepserve.engine.patched.layout import PatchLayout, from_patches, patch_side, to_patches
from stepserve.engine.patched.modules import HaloConv, NormStats, PatchBatch, StitchedGroupNorm, WholeImageTransformer

DOWN_BLOCKS = (CrossAttnDownBlock2D, DownBlock2D)
UP_BLOCKS = (CrossAttnUpBlock2D, UpBlock2D)
MID_BLOCKS = (UNetMidBlock2DCrossAttn,)


def patch_multiple(unet: UNet2DConditionModel) -> int:
    """What a patch side must be a multiple of: 2 per downsampler, so that at the deepest level a
    patch is still whole latent pixels and the downsamplers split it as they split the image."""
    return 2 ** sum(block.downsamplers is not None for block in unet.down_blocks)


def patched_unet_forward(unet: UNet2DConditionModel, samples: Sequence[torch.Tensor], timesteps: torch.Tensor,
                         encoder_hidden_states: torch.Tensor, added_cond_kwargs: dict[str, torch.Tensor] | None = None,
                         patch: int | None = None, stats: NormStats = NormStats.IMAGE) -> list[torch.Tensor]:
    """The UNet's output for `samples` (each [n, C, H, W], sizes may differ) in one forward over
    their patches. The other inputs are per row, rows in the order of the samples' rows:
    timesteps [rows], encoder_hidden_states [rows, L, D], added_cond_kwargs' tensors [rows, ...].
    `patch`: the patch side in latent pixels (default: the GCD of all sides)."""
    sizes = [tuple(s.shape[-2:]) for s in samples for _ in range(s.shape[0])]
    layout = PatchLayout.of(sizes, patch_side(sizes, patch_multiple(unet), patch))
    conditioning = {"timesteps": timesteps, "encoder_hidden_states": encoder_hidden_states,
                    **(added_cond_kwargs or {})}
    for name, value in conditioning.items():
        if value.shape[0] != len(sizes):
            raise ValueError(f"{name} has {value.shape[0]} rows for {len(sizes)} sample rows")
    batch = PatchBatch.on(layout, samples[0].device, stats)
    patches = torch.cat([to_patches(s, (s.shape[-2] // layout.patch, s.shape[-1] // layout.patch)) for s in samples])

    def per_patch(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, batch.image_of)

    with patched_modules(unet, batch):
        out = unet(patches, per_patch(timesteps), encoder_hidden_states=per_patch(encoder_hidden_states),
                   added_cond_kwargs={k: per_patch(v) for k, v in (added_cond_kwargs or {}).items()} or None,
                   return_dict=False)[0]
    results, first = [], 0
    for s in samples:
        grid = (s.shape[-2] // layout.patch, s.shape[-1] // layout.patch)
        count = s.shape[0] * grid[0] * grid[1]
        results.append(from_patches(out[first:first + count], grid))
        first += count
    return results


@contextmanager
def patched_modules(unet: UNet2DConditionModel, batch: PatchBatch) -> Iterator[None]:
    """While open, `unet` runs over `batch`'s patches: its spatial modules are swapped for the
    stand-ins and its 3x3 convolutions have padding 0 (their input comes with a halo). Everything
    is put back on exit, also after an error. Not reentrant: one forward at a time per UNet."""
    swaps, unpadded = _plan(unet, batch)
    places = [(parent, name, child) for parent in unet.modules() for name, child in parent._modules.items()
              if child is not None and child in swaps]
    paddings = [(conv, conv.padding) for conv in unpadded]
    try:
        for parent, name, child in places:
            parent._modules[name] = swaps[child]
        for conv, _ in paddings:
            conv.padding = (0, 0)
        yield
    finally:
        for parent, name, child in places:
            parent._modules[name] = child
        for conv, padding in paddings:
            conv.padding = padding


def _plan(unet: UNet2DConditionModel, batch: PatchBatch) -> tuple[dict[nn.Module, nn.Module], set[nn.Conv2d]]:
    """The stand-in for each module to swap, and the 3x3 convolutions that get halo'd input;
    ValueError for any part of the UNet not known to be exact over patches."""
    _check_blocks(unet)
    swaps: dict[nn.Module, nn.Module] = {}
    unpadded: set[nn.Conv2d] = set()

    def fuse(norm: nn.Module, activation: nn.Module, conv: nn.Module) -> None:
        # GroupNorm -> activation -> 3x3 conv: the GroupNorm writes the halo; the activation must
        # keep the border's zeros zero.
        if not isinstance(norm, nn.GroupNorm) or torch.count_nonzero(activation(torch.zeros(1))):
            raise ValueError(f"patched forward needs GroupNorm -> zero-keeping activation -> conv, got "
                             f"{type(norm).__name__} -> {activation}")
        _check_halo_conv(conv)
        swaps[norm] = StitchedGroupNorm(norm, batch)
        unpadded.add(conv)

    for resnet in (m for m in unet.modules() if isinstance(m, ResnetBlock2D)):
        if resnet.upsample is not None or resnet.downsample is not None or resnet.time_embedding_norm != "default":
            raise ValueError("patched forward: ResnetBlock2D with up/downsampling or a scale-shift time norm")
        fuse(resnet.norm1, resnet.nonlinearity, resnet.conv1)
        fuse(resnet.norm2, resnet.nonlinearity, resnet.conv2)
    if unet.conv_norm_out is not None:
        fuse(unet.conv_norm_out, unet.conv_act, unet.conv_out)
    for module in _outside_transformers(unet):
        if isinstance(module, Transformer2DModel):
            if not module.is_input_continuous:
                raise ValueError("patched forward: only Transformer2DModels over continuous latents")
            swaps[module] = WholeImageTransformer(module, batch)
        elif isinstance(module, nn.GroupNorm) and module not in swaps:
            raise ValueError("patched forward: a GroupNorm that does not feed a 3x3 convolution")
        elif isinstance(module, nn.Conv2d) and module not in unpadded and module.kernel_size != (1, 1):
            _check_halo_conv(module)
            swaps[module] = HaloConv(module, batch)
            unpadded.add(module)
        elif isinstance(module, (nn.ConvTranspose2d, Attention)):
            raise ValueError(f"patched forward: {type(module).__name__} outside a Transformer2DModel")
    return swaps, unpadded


def _check_blocks(unet: UNet2DConditionModel) -> None:
    blocks = [(b, DOWN_BLOCKS) for b in unet.down_blocks] + [(b, UP_BLOCKS) for b in unet.up_blocks]
    if unet.mid_block is not None:
        blocks.append((unet.mid_block, MID_BLOCKS))
    unknown = sorted({type(b).__name__ for b, known in blocks if not isinstance(b, known)})
    if unknown:
        raise ValueError(f"patched forward: blocks {unknown} are not supported")
    if any(getattr(b, "s1", None) for b in unet.up_blocks):
        raise ValueError("patched forward: FreeU filters whole images in Fourier space; disable it")
    if unet.config.addition_embed_type == "image_hint":
        raise ValueError("patched forward: image-hint conditioning is not supported")


def _check_halo_conv(conv: nn.Module) -> None:
    """A 3x3 convolution with zero padding 1: its zero padding is what the halo reproduces at
    image borders (stride 2 included: patch offsets are even, so windows line up)."""
    if not (isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3) and conv.padding == (1, 1)
            and conv.dilation == (1, 1) and conv.padding_mode == "zeros"):
        raise ValueError(f"patched forward: only 3x3 convolutions with zero padding 1, got {conv}")


def _outside_transformers(module: nn.Module) -> Iterator[nn.Module]:
    """The module and its descendants, Transformer2DModels included but not their insides."""
    yield module
    if not isinstance(module, Transformer2DModel):
        for child in module.children():
            yield from _outside_transformers(child)
