"""Patch-aware stand-ins for a UNet's spatial modules, for the length of one patched forward
(PatchedServe §4.2): each wraps the diffusers module it replaces and calls it, so the module's
own weights, attention processor and hooks (per-row LoRAs) serve as before.

- `StitchedGroupNorm`: a GroupNorm that feeds a 3x3 convolution; returns the normalized patches
  with their neighbours' edges around them (`kernels.patch_stitch.group_norm_stitch`), and the
  convolution runs with padding 0 (`unet.patched_modules` sets it).
- `HaloConv`: a 3x3 convolution with no GroupNorm before it (the UNet's input, the
  downsamplers' and upsamplers' convolutions): stitches the halo itself, then convolves.
- `WholeImageTransformer`: a Transformer2DModel run over whole images, regrouped from their
  patches and batched by resolution, since self-attention mixes all of an image's tokens;
  cross-attention takes each image's own text rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from diffusers import Transformer2DModel
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from stepserve.engine.patched.layout import PatchLayout, from_patches, to_patches
from stepserve.kernels.patch_stitch import group_norm_stitch, stitch_halo


class NormStats(str, Enum):
    """Whose statistics a patch's GroupNorm uses."""

    IMAGE = "image"  # its whole image's, pooled over the image's patches: exact GroupNorm
    PATCH = "patch"  # its own (PatchedServe's stitcher): approximate, images differ from the unpatched model's


@dataclass(frozen=True)
class ImageGroup:
    """Images of one grid in a patched batch: their patches, in image order, and each one's first patch."""

    grid: tuple[int, int]
    patches: torch.Tensor  # [images * rows * cols] patch indices
    first_patches: torch.Tensor  # [images]


@dataclass(frozen=True)
class PatchBatch:
    """A layout's metadata on the forward's device: what the stand-ins read."""

    layout: PatchLayout
    neighbours: torch.Tensor  # [P, 8] int64, -1 at image borders
    image_of: torch.Tensor  # [P] int64
    owner: torch.Tensor | None  # whose GroupNorm statistics each patch uses; None: its own
    groups: tuple[ImageGroup, ...]

    @classmethod
    def on(cls, layout: PatchLayout, device: torch.device, stats: NormStats) -> "PatchBatch":
        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        first = layout.first_patch
        groups = tuple(
            ImageGroup(layout.grids[images[0]], tensor([p for i in images for p in range(first[i], first[i + 1])]),
                       tensor([first[i] for i in images]))
            for images in layout.same_grid()
        )
        image_of = tensor(layout.image_of())
        return cls(layout, tensor(layout.neighbours()).view(-1, 8), image_of,
                   image_of if stats is NormStats.IMAGE else None, groups)


class StitchedGroupNorm(nn.Module):
    def __init__(self, norm: nn.GroupNorm, batch: PatchBatch):
        super().__init__()
        self.norm = norm
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        return group_norm_stitch(x, self.batch.neighbours, norm.num_groups, norm.weight, norm.bias, norm.eps,
                                 self.batch.owner)


class HaloConv(nn.Module):
    def __init__(self, conv: nn.Conv2d, batch: PatchBatch):
        super().__init__()
        self.conv = conv
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(stitch_halo(x, self.batch.neighbours))


class WholeImageTransformer(nn.Module):
    def __init__(self, transformer: Transformer2DModel, batch: PatchBatch):
        super().__init__()
        self.transformer = transformer
        self.batch = batch

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                cross_attention_kwargs: dict[str, Any] | None = None, return_dict: bool = True) -> Any:
        """The UNet blocks' call, with per-patch rows in and out; every patch of an image carries
        that image's rows, so its first patch's stand for the image."""
        out = torch.empty_like(hidden_states)
        for group in self.batch.groups:
            first = group.first_patches
            images = from_patches(hidden_states.index_select(0, group.patches), group.grid)
            result = self.transformer(
                images, encoder_hidden_states=_rows(encoder_hidden_states, first),
                attention_mask=_rows(attention_mask, first),
                encoder_attention_mask=_rows(encoder_attention_mask, first),
                cross_attention_kwargs=cross_attention_kwargs, return_dict=False,
            )[0]
            out.index_copy_(0, group.patches, to_patches(result, group.grid))
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, index)
