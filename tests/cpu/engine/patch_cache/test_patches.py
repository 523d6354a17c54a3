"""The patch grid of the patch cache: per-patch sums and relative MSE against a brute force over
each patch's tokens, ragged edges included; the tokens a masked block computes."""

import pytest
import torch

from stepserve.engine.patch_cache.patches import PatchGrid

GRID = PatchGrid(rows=5, columns=7, side=3)  # 2 x 3 patches, the last row and column cut short


def _brute_patches(grid: PatchGrid) -> list[list[int]]:
    """Each patch's tokens, from the definition."""
    patches = [[] for _ in range(grid.patches)]
    for r in range(grid.rows):
        for c in range(grid.columns):
            patches[(r // grid.side) * grid.patch_columns + c // grid.side].append(r * grid.columns + c)
    return patches


def test_patch_counts_round_up():
    assert (GRID.patch_rows, GRID.patch_columns, GRID.patches, GRID.tokens) == (2, 3, 6, 35)
    assert PatchGrid(8, 8, 4).patches == 4
    with pytest.raises(ValueError, match="positive"):
        PatchGrid(8, 8, 0)


def test_patch_sums_and_relative_mse_match_a_brute_force():
    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(2, GRID.tokens, 4, generator=g), torch.randn(2, GRID.tokens, 4, generator=g)
    sums = GRID.patch_sums(x[..., 0])
    change = GRID.relative_mse(x, ref)
    assert change.shape == (2, GRID.patches)
    for p, tokens in enumerate(_brute_patches(GRID)):
        torch.testing.assert_close(sums[:, p], x[:, tokens, 0].sum(dim=1))
        expected = (x[:, tokens] - ref[:, tokens]).square().sum(dim=(1, 2)) / ref[:, tokens].square().sum(dim=(1, 2))
        torch.testing.assert_close(change[:, p], expected)


def test_relative_mse_is_zero_for_equal_inputs_and_finite_against_zeros():
    x = torch.randn(1, GRID.tokens, 4)
    assert GRID.relative_mse(x, x).abs().max() == 0
    assert torch.isfinite(GRID.relative_mse(x, torch.zeros_like(x))).all()


def test_token_mask_spreads_each_patch_over_its_tokens():
    values = torch.arange(GRID.patches).reshape(1, -1)
    spread = GRID.token_mask(values).flatten(1)
    for p, tokens in enumerate(_brute_patches(GRID)):
        assert spread[0, tokens].tolist() == [p] * len(tokens)


def test_computed_tokens_are_the_recomputed_patches_tokens_padded_with_the_first():
    recompute = torch.zeros(3, GRID.patches, dtype=torch.bool)
    recompute[0, [1, 5]] = True
    recompute[1, 3] = True  # row 2 recomputes nothing: token 0 alone, the batch stays rectangular
    index = GRID.computed_tokens(recompute)
    patches = _brute_patches(GRID)
    row0 = sorted(patches[1] + patches[5])
    assert index.shape == (3, len(row0))
    assert index[0].tolist() == row0
    assert index[1].tolist() == patches[3] + [patches[3][0]] * (len(row0) - len(patches[3]))
    assert index[2].tolist() == [0] * len(row0)
