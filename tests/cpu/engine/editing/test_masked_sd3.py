"""Mask-aware SD3 forwards on the tiny transformer: plain and recording equal the model's own
forward; masked with a cache recorded from the same inputs equals it too (the unmasked tokens'
cached outputs are what would have been computed), whatever blocks use the cache and however
rows are padded; masked with another input's cache stays close (a fidelity sanity)."""

import pytest
import torch
from diffusers import SD3Transformer2DModel

from stepserve.engine.editing.masked_sd3 import (
    MaskedPlan, SD3Inputs, masked_forward, plain_forward, recording_forward, token_index,
)
from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.families.sd3 import TINY

from tests.tiny import TINY_SD3

LATENT = 16  # latent side: 8 x 8 = 64 tokens of patch 2
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def preset():
    """The tiny preset's transformer: block 0 has dual attention, block 1 is the last
    (`context_pre_only`)."""
    return load_family(TINY_SD3, {DENOISER}, "cpu").denoiser


@pytest.fixture(scope="module")
def three_blocks():
    """The same sizes with three blocks, so one block is neither dual nor last."""
    torch.manual_seed(3)
    return SD3Transformer2DModel(**{**TINY["transformer"], "num_layers": 3}).eval()


@pytest.fixture(params=["preset", "three_blocks"])
def transformer(request):
    return request.getfixturevalue(request.param)


def _inputs(transformer, rows=2, seed=0, text_tokens=7) -> SD3Inputs:
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    return SD3Inputs(
        hidden_states=torch.randn(rows, cfg.in_channels, LATENT, LATENT, generator=g),
        encoder_hidden_states=torch.randn(rows, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(rows, cfg.pooled_projection_dim, generator=g),
        timestep=torch.tensor([700.0, 300.0][:rows]),
    )


def _reference(transformer, inputs: SD3Inputs) -> torch.Tensor:
    with torch.inference_mode():
        return transformer(hidden_states=inputs.hidden_states, encoder_hidden_states=inputs.encoder_hidden_states,
                           pooled_projections=inputs.pooled_projections, timestep=inputs.timestep,
                           return_dict=False)[0]


def _box_mask(rows, top, left, height, width) -> torch.Tensor:
    mask = torch.zeros(rows, 1, LATENT, LATENT)
    mask[:, :, top : top + height, left : left + width] = 1
    return mask


def test_token_index_follows_the_patch_grid_and_pads_with_the_first_token():
    mask = torch.zeros(3, 1, 4, 6)  # a 2 x 3 patch grid of patch 2
    mask[0, 0, 0, 0] = 1  # one pixel makes patch (0, 0) masked
    mask[0, 0, 3, 5] = 1  # patch (1, 2) = token 5
    mask[1, 0, 2:4, 2:4] = 1  # patch (1, 1) = token 4
    index = token_index(mask, 2)
    assert index.dtype == torch.long
    assert index.tolist() == [[0, 5], [4, 4], [0, 0]]  # row 2's mask is empty: token 0 alone


def test_token_index_order_is_the_patch_embedding_order(preset):
    """A token's index is its position in `pos_embed`'s output: patch embeddings of a latent
    that is non-zero only inside the masked patch differ from those of zeros exactly there."""
    mask = _box_mask(1, 6, 10, 2, 2)
    (token,) = token_index(mask, 2)[0].tolist()
    with torch.inference_mode():
        inside = preset.pos_embed(torch.randn(1, 16, LATENT, LATENT) * mask)
        moved = inside - preset.pos_embed(torch.zeros(1, 16, LATENT, LATENT))
    assert torch.nonzero(moved.abs().sum(-1)[0]).flatten().tolist() == [token]


def test_plain_and_recording_equal_the_model(transformer):
    inputs = _inputs(transformer)
    expected = _reference(transformer, inputs)
    torch.testing.assert_close(plain_forward(transformer, inputs), expected, atol=0, rtol=0)
    out, blocks = recording_forward(transformer, inputs)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    hidden = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    assert [b.shape for b in blocks] == [(2, (LATENT // 2) ** 2, hidden)] * len(transformer.transformer_blocks)


def test_all_tokens_masked_equals_plain(transformer):
    """Every token recomputed: the cache content cannot matter (here it is garbage)."""
    inputs = _inputs(transformer)
    index = token_index(torch.ones(2, 1, LATENT, LATENT), 2)
    garbage = [torch.randn(2, index.shape[1], 32) * 1e3] * len(transformer.transformer_blocks)
    plan = MaskedPlan(index, garbage, [True] * len(garbage))
    torch.testing.assert_close(masked_forward(transformer, inputs, plan), _reference(transformer, inputs), **TOL)


@pytest.mark.parametrize("use_cache", ["all", "mixed", "none"])
def test_masked_with_its_own_cache_equals_plain(transformer, use_cache):
    """A quarter of the tokens masked (4 x 4 of 8 x 8 patches): with activations recorded from
    the same inputs, the unmasked tokens' cached outputs are exactly what would be computed."""
    inputs = _inputs(transformer)
    expected, cache = recording_forward(transformer, inputs)
    index = token_index(_box_mask(2, 4, 6, 8, 8), 2)
    assert index.shape == (2, 16)
    n = len(cache)
    flags = {"all": [True] * n, "mixed": [b % 2 == 1 for b in range(n)], "none": [False] * n}[use_cache]
    asked = []
    plan = MaskedPlan(index, lambda b: asked.append(b) or cache[b], flags)
    torch.testing.assert_close(masked_forward(transformer, inputs, plan), expected, **TOL)
    assert asked == [b for b in range(n) if flags[b]]  # only blocks that use the cache are loaded


def test_rows_with_different_masks_pad_exactly(transformer):
    """Row 0 masks 16 tokens, row 1 only 2: row 1 is padded with its first masked token."""
    inputs = _inputs(transformer)
    expected, cache = recording_forward(transformer, inputs)
    mask = _box_mask(2, 0, 0, 8, 8)
    mask[1] = 0
    mask[1, :, 10:12, 2:6] = 1  # patches (5, 1) and (5, 2)
    index = token_index(mask, 2)
    assert index.shape == (2, 16) and index[1].tolist() == [41, 42] + [41] * 14
    plan = MaskedPlan(index, cache, [True] * len(cache))
    torch.testing.assert_close(masked_forward(transformer, inputs, plan), expected, **TOL)


def test_a_template_cache_changes_the_result_only_modestly(preset):
    """An edit of a template that differs from it only under the mask, computed with the
    template's cache, is much closer to the exact edit than the template's own prediction is."""
    template = _inputs(preset, seed=0)
    mask = _box_mask(2, 4, 4, 8, 8)
    edit = SD3Inputs(template.hidden_states + mask * torch.randn_like(template.hidden_states),
                     template.encoder_hidden_states, template.pooled_projections, template.timestep)
    template_out, cache = recording_forward(preset, template)
    exact = plain_forward(preset, edit)
    approx = masked_forward(preset, edit, MaskedPlan(token_index(mask, 2), cache, [True] * len(cache)))
    approx_error = (approx - exact).norm() / exact.norm()
    assert 0 < approx_error < 0.1 * (template_out - exact).norm() / exact.norm()


def test_use_cache_must_name_every_block(preset):
    inputs = _inputs(preset)
    plan = MaskedPlan(token_index(_box_mask(2, 0, 0, 2, 2), 2), [], [True])
    with pytest.raises(ValueError, match="2 blocks"):
        masked_forward(preset, inputs, plan)
