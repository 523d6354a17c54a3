"""Patch edge stitching fused with GroupNorm (PatchedServe §4.3): a batch of square patches cut
from images of different sizes is normalized and each patch gets a one-pixel halo of its
neighbours' edge pixels, so a 3x3 convolution with padding 0 over the padded patches computes
what the convolution with padding 1 computes over the whole images.

Neighbour metadata is per patch: `neighbours` [P, 8] holds, in `NEIGHBOUR_OFFSETS` order, the
index of the patch one step away in the patch grid of its image, or -1 where that side is the
image border; there the halo is zero, as the convolution's own zero padding would be. Corners
come from the diagonal neighbours: a 3x3 window at a patch corner reads them.

GroupNorm statistics are per *owner*: `owner` [P] names, for each patch, the statistics group it
shares (its image: exact GroupNorm of the whole image; None: each patch its own, the paper's
cheaper approximation that makes its images differ from the unpatched model's). Each patch's
moments (mean and sum of squared deviations per group) come from one pass over it; those of an
owner are combined from its patches' with Chan's formula on [P, groups]-sized tensors, so exact
per-image statistics cost no second pass over the activations.

A halo cell takes its neighbour's normalized value (normalized with that neighbour's statistics),
so what follows the normalization must keep zero at zero (SiLU does) for the border halo to stay
the convolution's zero padding.

The Triton kernels (CUDA only; Triton is optional and not installed where the CPU tests run) pull
each output cell of a padded patch from its own patch or a neighbour: no write races and no
zero-fill pass; the torch reference is what they are checked against (`tests/gpu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch reference serves every call
    triton = None

# (row, column) offsets in the patch grid of the eight neighbours, in the order of `neighbours`' columns.
NEIGHBOUR_OFFSETS = ((-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1))


def stitch_halo(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Patches x [P, C, h, w] with their neighbours' edges around them: [P, C, h + 2, w + 2]."""
    _check(x, neighbours)
    if _triton_serves(x):
        return _triton_stitch(x, neighbours, None, None, None, None)
    return reference_stitch_halo(x, neighbours)


def group_norm_stitch(x: torch.Tensor, neighbours: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float, owner: torch.Tensor | None) -> torch.Tensor:
    """GroupNorm of patches x [P, C, h, w] with statistics pooled per `owner` (None: per patch),
    stitched: [P, C, h + 2, w + 2] in x's dtype."""
    _check(x, neighbours)
    mean, rstd = group_statistics(x, num_groups, eps, owner)
    if _triton_serves(x):
        return _triton_stitch(x, neighbours, mean, rstd, weight, bias)
    return reference_stitch_halo(normalize(x, mean, rstd, weight, bias), neighbours)


def reference_group_norm_stitch(x: torch.Tensor, neighbours: torch.Tensor, num_groups: int,
                                weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                                owner: torch.Tensor | None) -> torch.Tensor:
    """`group_norm_stitch` in torch only, on any device (what the Triton kernels are checked against)."""
    _check(x, neighbours)
    mean, rstd = pooled_statistics(*reference_moments(x, num_groups), _group_size(x, num_groups), eps, owner)
    return reference_stitch_halo(normalize(x, mean, rstd, weight, bias), neighbours)


def reference_stitch_halo(x: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """`stitch_halo` in torch: zero padding, then each of the eight halo strips copied from its neighbour."""
    _, _, h, w = x.shape
    out = F.pad(x, (1, 1, 1, 1))
    for slot, (dy, dx) in enumerate(NEIGHBOUR_OFFSETS):
        (source_rows, halo_rows), (source_cols, halo_cols) = _edge(dy, h), _edge(dx, w)
        source = neighbours[:, slot]
        edge = x[:, :, source_rows, source_cols][source.clamp(min=0)]  # only the edge strip is copied
        out[:, :, halo_rows, halo_cols] = torch.where((source >= 0).view(-1, 1, 1, 1), edge, 0)
    return out


def _edge(offset: int, size: int) -> tuple[slice, slice]:
    """Along one axis: the neighbour's strip a halo takes, and where it goes in the padded patch."""
    if offset < 0:  # the neighbour above (left): its last row (column) becomes the top (left) halo
        return slice(size - 1, size), slice(0, 1)
    if offset > 0:
        return slice(0, 1), slice(size + 1, size + 2)
    return slice(0, size), slice(1, size + 1)


def group_statistics(x: torch.Tensor, num_groups: int, eps: float,
                     owner: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch and group, the mean and 1/sqrt(var + eps) of its owner's elements: [P, groups] float32."""
    moments = _triton_moments(x, num_groups) if _triton_serves(x) else reference_moments(x, num_groups)
    return pooled_statistics(*moments, _group_size(x, num_groups), eps, owner)


def reference_moments(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's per-group mean and sum of squared deviations, in float32: [P, groups] each."""
    n = _group_size(x, num_groups)
    var, mean = torch.var_mean(x.reshape(x.shape[0], num_groups, n).float(), dim=-1, correction=0)
    return mean, var * n


def pooled_statistics(mean: torch.Tensor, m2: torch.Tensor, n: int, eps: float,
                      owner: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) per patch from patch moments of `n` elements each, pooled per owner (Chan et
    al.'s parallel variance: the pooled M2 is the patches' M2 plus n times their squared mean
    deviations; patches are equal-sized, so the pooled mean is the mean of their means)."""
    if owner is None:
        return mean, torch.rsqrt(m2 / n + eps)
    # Owners are numbered below P, so [P, groups] accumulators hold them without a count from the device.
    patches = torch.zeros(mean.shape[0], device=mean.device).index_add_(0, owner, torch.ones_like(mean[:, 0]))
    count = patches.clamp(min=1)[owner].unsqueeze(1)
    pooled_mean = torch.zeros_like(mean).index_add_(0, owner, mean)[owner] / count
    deviation = m2 + n * (mean - pooled_mean) ** 2
    pooled_m2 = torch.zeros_like(m2).index_add_(0, owner, deviation)[owner]
    return pooled_mean, torch.rsqrt(pooled_m2 / (count * n) + eps)


def normalize(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [P, C, h, w] normalized with per-(patch, group) statistics [P, groups], affine per channel."""
    p, c, h, w = x.shape
    y = (x.reshape(p, mean.shape[1], -1).float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = y.view(p, c, h, w)
    if weight is not None:
        y = y * weight.float().view(1, c, 1, 1) + bias.float().view(1, c, 1, 1)
    return y.to(x.dtype)


def _group_size(x: torch.Tensor, num_groups: int) -> int:
    """Elements of one patch's group (its channels times its pixels)."""
    if x.shape[1] % num_groups:
        raise ValueError(f"{x.shape[1]} channels do not split into {num_groups} groups")
    return x[0].numel() // num_groups


def _check(x: torch.Tensor, neighbours: torch.Tensor) -> None:
    if x.dim() != 4 or neighbours.shape != (x.shape[0], len(NEIGHBOUR_OFFSETS)):
        raise ValueError(f"expected patches [P, C, h, w] and neighbours [P, 8]; got {tuple(x.shape)}, "
                         f"{tuple(neighbours.shape)}")


def _triton_serves(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# ---- Triton (CUDA) ----------------------------------------------------------------------

MOMENTS_BLOCK = 1024
STITCH_BLOCK = 1024


def _triton_moments(x: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0] * num_groups
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    m2 = torch.empty_like(mean)
    _moments_kernel[(rows,)](x.contiguous(), mean, m2, _group_size(x, num_groups), BLOCK=MOMENTS_BLOCK)
    return mean.view(-1, num_groups), m2.view(-1, num_groups)


def _triton_stitch(x: torch.Tensor, neighbours: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor | None,
                   weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    p, c, h, w = x.shape
    x = x.contiguous()
    out = torch.empty(p, c, h + 2, w + 2, device=x.device, dtype=x.dtype)
    normalized = mean is not None
    groups = mean.shape[1] if normalized else 1
    grid = (p * c, triton.cdiv((h + 2) * (w + 2), STITCH_BLOCK))
    # Unused pointer arguments get x: the kernel never reads them (NORMALIZE / AFFINE are off).
    _stitch_kernel[grid](
        x, out, neighbours.to(torch.int64).contiguous(),
        mean.contiguous() if normalized else x, rstd.contiguous() if normalized else x,
        weight if weight is not None else x, bias if bias is not None else x,
        c, h, w, groups, c // groups,
        NORMALIZE=normalized, AFFINE=normalized and weight is not None, BLOCK=STITCH_BLOCK,
    )
    return out


if triton is not None:
    @triton.jit
    def _moments_kernel(x_ptr, mean_ptr, m2_ptr, n, BLOCK: tl.constexpr):
        """One (patch, group) row of n contiguous elements: its mean and M2, chunks merged with Chan's formula."""
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * n
        mean = tl.zeros((), dtype=tl.float32)
        m2 = tl.zeros((), dtype=tl.float32)
        count = tl.zeros((), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < n
            v = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
            k = tl.sum(inside.to(tl.float32), axis=0)
            chunk_mean = tl.sum(v, axis=0) / k
            d = tl.where(inside, v - chunk_mean, 0.0)
            total = count + k
            delta = chunk_mean - mean
            mean = mean + delta * (k / total)
            m2 = m2 + tl.sum(d * d, axis=0) + delta * delta * (count * k / total)
            count = total
        tl.store(mean_ptr + row, mean)
        tl.store(m2_ptr + row, m2)

    @triton.jit
    def _stitch_kernel(x_ptr, out_ptr, nb_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, C, H, W, G, channels_per_group,
                       NORMALIZE: tl.constexpr, AFFINE: tl.constexpr, BLOCK: tl.constexpr):
        """One block of one padded output plane (patch p, channel c): each cell reads its value from
        the patch itself (interior) or from the neighbour its halo side faces (-1: zero)."""
        plane = tl.program_id(0)
        p = plane // C
        c = plane % C
        padded_w = W + 2
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < (H + 2) * padded_w
        i = offs // padded_w
        j = offs % padded_w
        dy = tl.where(i == 0, -1, tl.where(i == H + 1, 1, 0))
        dx = tl.where(j == 0, -1, tl.where(j == W + 1, 1, 0))
        cell = (dy + 1) * 3 + (dx + 1)  # 4: the interior
        slot = tl.where(cell > 4, cell - 1, cell)
        neighbour = tl.load(nb_ptr + p * 8 + slot, mask=inside & (cell != 4), other=-1)
        source = tl.where(cell == 4, p, neighbour).to(tl.int64)
        valid = inside & (source >= 0)
        row = tl.where(dy == -1, H - 1, tl.where(dy == 1, 0, i - 1))
        col = tl.where(dx == -1, W - 1, tl.where(dx == 1, 0, j - 1))
        v = tl.load(x_ptr + ((source * C + c) * H + row) * W + col, mask=valid, other=0.0).to(tl.float32)
        if NORMALIZE:
            g = c // channels_per_group
            mean = tl.load(mean_ptr + source * G + g, mask=valid, other=0.0)
            rstd = tl.load(rstd_ptr + source * G + g, mask=valid, other=0.0)
            v = (v - mean) * rstd
            if AFFINE:
                v = v * tl.load(w_ptr + c).to(tl.float32) + tl.load(b_ptr + c).to(tl.float32)
            v = tl.where(valid, v, 0.0)
        tl.store(out_ptr + plane.to(tl.int64) * (H + 2) * padded_w + offs, v.to(out_ptr.dtype.element_ty),
                 mask=inside)
