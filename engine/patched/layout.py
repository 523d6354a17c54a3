"""Where each patch of a patched batch comes from (PatchedServe §4.1): images of different sizes
cut into square patches of one side, so one UNet forward runs over all of them.

Each image's patches are contiguous and row-major (the paper's per-request offset: image i owns
patches `first_patch[i]` to `first_patch[i + 1]`); per patch the layout says its image and its
eight neighbours in that image's patch grid (-1 at the image border), which the convolutions'
halo exchange reads (`kernels.patch_stitch`). The grid is the same at every UNet level: a
downsampler halves every patch, so the neighbour metadata never changes within a forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from stepserve.kernels.patch_stitch import NEIGHBOUR_OFFSETS


def patch_side(sizes: Iterable[tuple[int, int]], multiple: int, configured: int | None = None) -> int:
    """The patch side (latent pixels) for images of these (height, width): `configured` if given,
    else the largest that tiles them all (the GCD of their sides, as the paper chooses). It must
    divide every side and be a multiple of `multiple` (the UNet's total downscale: a patch
    must stay whole pixels, split as the image is, at the deepest level)."""
    sides = [side for size in sizes for side in size]
    if not sides:
        raise ValueError("no images to patch")
    side = configured if configured is not None else math.gcd(*sides)
    if side <= 0 or any(s % side for s in sides):
        raise ValueError(f"patch side {side} does not divide every image side {sorted(set(sides))}")
    if side % multiple:
        raise ValueError(f"patch side {side} is not a multiple of {multiple} (the UNet's downscale); "
                         f"images {sorted(set(sides))} cannot share a patched forward")
    return side


@dataclass(frozen=True)
class PatchLayout:
    """A patched batch: patch side and each image's patch grid (rows, columns), images in order."""

    patch: int
    grids: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, sizes: Sequence[tuple[int, int]], patch: int) -> "PatchLayout":
        """The layout of images of these latent (height, width), cut into patch x patch squares."""
        if any(h % patch or w % patch for h, w in sizes):
            raise ValueError(f"patch side {patch} does not tile the images {list(sizes)}")
        return cls(patch, tuple((h // patch, w // patch) for h, w in sizes))

    @property
    def first_patch(self) -> tuple[int, ...]:
        """Per image its first patch's index, then the total (CSR offsets)."""
        offsets = [0]
        for rows, cols in self.grids:
            offsets.append(offsets[-1] + rows * cols)
        return tuple(offsets)

    @property
    def num_patches(self) -> int:
        return self.first_patch[-1]

    def image_of(self) -> list[int]:
        """Per patch, its image."""
        return [i for i, (rows, cols) in enumerate(self.grids) for _ in range(rows * cols)]

    def neighbours(self) -> list[list[int]]:
        """Per patch, its neighbours' indices in `NEIGHBOUR_OFFSETS` order, -1 past the image border."""
        out = []
        for first, (rows, cols) in zip(self.first_patch, self.grids):
            for r in range(rows):
                for c in range(cols):
                    out.append([first + (r + dy) * cols + (c + dx) if 0 <= r + dy < rows and 0 <= c + dx < cols
                                else -1 for dy, dx in NEIGHBOUR_OFFSETS])
        return out

    def same_grid(self) -> list[list[int]]:
        """The images grouped by grid (= resolution), groups in order of first appearance: what
        whole-image operators (self-attention) batch together."""
        groups: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(self.grids):
            groups.setdefault(grid, []).append(image)
        return list(groups.values())


def to_patches(images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """images [n, C, rows * h, cols * w] as n * rows * cols patches [., C, h, w], each image's row-major."""
    n, c, height, width = images.shape
    rows, cols = grid
    h, w = height // rows, width // cols
    patches = images.reshape(n, c, rows, h, cols, w).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(n * rows * cols, c, h, w)


def from_patches(patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The inverse of `to_patches`: [n * rows * cols, C, h, w] back to images [n, C, rows * h, cols * w]."""
    _, c, h, w = patches.shape
    rows, cols = grid
    images = patches.reshape(-1, rows, cols, c, h, w).permute(0, 3, 1, 4, 2, 5)
    return images.reshape(-1, c, rows * h, cols * w)
