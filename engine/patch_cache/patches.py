"""Square patches of image tokens: the unit the patch cache decides on (PatchedServe §5.1).

A DiT's image tokens are its latent patches in row-major order over a (rows x columns) grid; a
cache patch groups `side` x `side` of those tokens. Sides need not divide the grid: the last
patches of a row or column are cut short. A block's reuse decision is per patch, its computation
per token, so the grid maps between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stepserve.engine.editing.masked_sd3 import token_index

# Keeps a relative difference finite where the cached patch is all zeros.
_TINY = 1e-20


@dataclass(frozen=True)
class PatchGrid:
    """A (rows x columns) token grid cut into `side` x `side` patches."""

    rows: int
    columns: int
    side: int

    def __post_init__(self) -> None:
        if min(self.rows, self.columns, self.side) < 1:
            raise ValueError(f"a patch grid needs positive sizes, got {self.rows} x {self.columns}, side {self.side}")

    @property
    def tokens(self) -> int:
        return self.rows * self.columns

    @property
    def patch_rows(self) -> int:
        return -(-self.rows // self.side)

    @property
    def patch_columns(self) -> int:
        return -(-self.columns // self.side)

    @property
    def patches(self) -> int:
        return self.patch_rows * self.patch_columns

    def patch_sums(self, per_token: torch.Tensor) -> torch.Tensor:
        """[B, tokens] -> each patch's sum, [B, patches] in row-major patch order. A reshape and a
        sum, not an `index_add_`: CUDA's atomics would sum in varying order, and a decision made
        on the last bit must not change from run to run."""
        b = per_token.shape[0]
        grid = per_token.reshape(b, self.rows, self.columns)
        cut = (0, self.patch_columns * self.side - self.columns, 0, self.patch_rows * self.side - self.rows)
        grid = F.pad(grid, cut)
        return grid.reshape(b, self.patch_rows, self.side, self.patch_columns, self.side).sum(dim=(2, 4)).flatten(1)

    def relative_mse(self, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Per patch, |x - reference|^2 / |reference|^2 over its tokens and features, in float32:
        x, reference [B, tokens, H] -> [B, patches]. Relative, so one threshold serves blocks
        whose activations differ in scale."""
        x, reference = x.float(), reference.float()
        difference = self.patch_sums((x - reference).square().sum(dim=-1))
        return difference / self.patch_sums(reference.square().sum(dim=-1)).clamp_min(_TINY)

    def token_mask(self, per_patch: torch.Tensor) -> torch.Tensor:
        """[B, patches] -> each token's patch's value, [B, rows, columns]; on the input's device."""
        b, side = per_patch.shape[0], self.side
        spread = per_patch.reshape(b, self.patch_rows, 1, self.patch_columns, 1).expand(-1, -1, side, -1, side)
        return spread.reshape(b, self.patch_rows * side, self.patch_columns * side)[:, :self.rows, :self.columns]

    def computed_tokens(self, recompute: torch.Tensor) -> torch.Tensor:
        """The tokens a masked block computes, [B, M], from the patches to recompute [B, patches]
        (bool): `engine.editing.masked_sd3.token_index`'s order and padding (each row's tokens in
        order, shorter rows repeating their first; a row recomputing nothing computes token 0, so
        the batch stays rectangular and M >= 1)."""
        return token_index(self.token_mask(recompute).unsqueeze(1), 1)
