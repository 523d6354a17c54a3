"""The keys-and-values cache (InstGenIE Fig. 7) on the tiny SD3 transformer: its record is the
plain forward's, one tensor per slot; a masked forward with a record of its own inputs equals the
plain one (the cached keys and values are those the attention used, the cached final tokens the
plain output), however rows are padded and whichever blocks have dual attention or end the text
stream; with every token masked the record cannot matter; with another input's record the result
stays close; plans that would need the unmasked tokens' inputs are refused."""

import pytest
import torch
from diffusers import SD3Transformer2DModel

from stepserve.engine.editing.block_loader import BlockLoader
from stepserve.engine.editing.masked_sd3 import (
    CacheKind, MaskedPlan, SD3Inputs, cache_slots, masked_forward, plain_forward, recording_forward, token_index,
)
from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.families.sd3 import TINY

from tests.tiny import TINY_SD3

LATENT = 16  # latent side: 8 x 8 = 64 tokens of patch 2
TOKENS = (LATENT // 2) ** 2
KV = CacheKind.KEYS_VALUES
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def preset():
    """The tiny preset's transformer: block 0 has dual attention, block 1 is the last
    (`context_pre_only`); both have rms_norm q/k norms."""
    return load_family(TINY_SD3, {DENOISER}, "cpu").denoiser


@pytest.fixture(scope="module")
def three_blocks():
    """The same sizes with three blocks, so one block is neither dual nor last."""
    torch.manual_seed(3)
    return SD3Transformer2DModel(**{**TINY["transformer"], "num_layers": 3}).eval()


@pytest.fixture(scope="module")
def no_qk_norm():
    """SD3-medium's kind of block: no dual attention, no q/k norm (keys come from the projection)."""
    torch.manual_seed(4)
    config = {**TINY["transformer"], "num_layers": 2, "dual_attention_layers": (), "qk_norm": None}
    return SD3Transformer2DModel(**config).eval()


@pytest.fixture(params=["preset", "three_blocks", "no_qk_norm"])
def transformer(request):
    return request.getfixturevalue(request.param)


def _inputs(transformer, seed=0, text_tokens=7) -> SD3Inputs:
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    return SD3Inputs(
        hidden_states=torch.randn(2, cfg.in_channels, LATENT, LATENT, generator=g),
        encoder_hidden_states=torch.randn(2, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g),
        timestep=torch.tensor([700.0, 300.0]),
    )


def _box_mask(top, left, height, width) -> torch.Tensor:
    mask = torch.zeros(2, 1, LATENT, LATENT)
    mask[:, :, top : top + height, left : left + width] = 1
    return mask


def _plan(index, cached, slots) -> MaskedPlan:
    return MaskedPlan(index, cached, [True] * slots, KV)


def test_the_record_is_the_plain_forward_one_tensor_per_slot(transformer):
    inputs = _inputs(transformer)
    out, record = recording_forward(transformer, inputs, KV)
    torch.testing.assert_close(out, plain_forward(transformer, inputs), atol=0, rtol=0)
    cfg = transformer.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    blocks = transformer.transformer_blocks
    assert len(record) == cache_slots(transformer, KV) == len(blocks) + 1
    assert [r.shape for r in record[:-1]] == [(2, 4 if b.use_dual_attention else 2, TOKENS, inner) for b in blocks]
    assert record[-1].shape == (2, TOKENS, cfg.patch_size ** 2 * cfg.out_channels)


def test_recorded_keys_are_what_the_attention_uses(preset):
    """Block 1's keys by hand from its input, as `JointAttnProcessor2_0` computes them: the q/k
    norm per head, image tokens only."""
    inputs = _inputs(preset)
    seen = {}
    hook = preset.transformer_blocks[1].register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        _, record = recording_forward(preset, inputs, KV)
    finally:
        hook.remove()
    block = preset.transformer_blocks[1]
    attn = block.attn
    with torch.inference_mode():
        normed = block.norm1(seen["hidden_states"], emb=seen["temb"])[0]
        keys = attn.to_k(normed).view(2, TOKENS, attn.heads, -1).transpose(1, 2)
        keys = attn.norm_k(keys).transpose(1, 2).flatten(2)
    torch.testing.assert_close(record[1][:, 0], keys, atol=0, rtol=0)
    torch.testing.assert_close(record[1][:, 1], attn.to_v(normed), atol=0, rtol=0)


def test_masked_with_its_own_record_equals_plain(transformer):
    """A quarter of the tokens masked: every other token's keys, values and final output are
    what the plain forward computes for it. Slots are asked once each, in slot order."""
    inputs = _inputs(transformer)
    expected, record = recording_forward(transformer, inputs, KV)
    index = token_index(_box_mask(4, 6, 8, 8), 2)
    assert index.shape == (2, 16)
    asked = []
    out = masked_forward(transformer, inputs, _plan(index, lambda s: asked.append(s) or record[s], len(record)))
    torch.testing.assert_close(out, expected, **TOL)
    assert asked == list(range(len(record)))


def test_rows_with_different_masks_pad_exactly(transformer):
    """Row 0 masks 16 tokens, row 1 only 2: row 1 is padded with its first masked token through
    every block (duplicate tokens compute, and write, the same keys, values and outputs)."""
    inputs = _inputs(transformer)
    expected, record = recording_forward(transformer, inputs, KV)
    mask = _box_mask(0, 0, 8, 8)
    mask[1] = 0
    mask[1, :, 10:12, 2:6] = 1  # patches (5, 1) and (5, 2)
    index = token_index(mask, 2)
    assert index.shape == (2, 16) and index[1].tolist() == [41, 42] + [41] * 14
    torch.testing.assert_close(masked_forward(transformer, inputs, _plan(index, record, len(record))), expected, **TOL)


def test_all_tokens_masked_equals_plain(transformer):
    """Every token recomputed: the record's content cannot matter (here it is garbage)."""
    inputs = _inputs(transformer)
    _, record = recording_forward(transformer, inputs, KV)
    garbage = [torch.randn_like(r) * 1e3 for r in record]
    index = token_index(torch.ones(2, 1, LATENT, LATENT), 2)
    out = masked_forward(transformer, inputs, _plan(index, garbage, len(garbage)))
    torch.testing.assert_close(out, plain_forward(transformer, inputs), **TOL)


def test_a_template_record_changes_the_result_only_modestly(preset):
    """An edit of a template that differs from it only under the mask, computed with the
    template's record, is much closer to the exact edit than the template's own prediction is,
    and the unmasked tokens' predictions are the template's."""
    template = _inputs(preset, seed=0)
    mask = _box_mask(4, 4, 8, 8)
    edit = SD3Inputs(template.hidden_states + mask * torch.randn_like(template.hidden_states),
                     template.encoder_hidden_states, template.pooled_projections, template.timestep)
    template_out, record = recording_forward(preset, template, KV)
    exact = plain_forward(preset, edit)
    approx = masked_forward(preset, edit, _plan(token_index(mask, 2), record, len(record)))
    approx_error = (approx - exact).norm() / exact.norm()
    assert 0 < approx_error < 0.1 * (template_out - exact).norm() / exact.norm()
    outside = mask.expand_as(exact) == 0
    torch.testing.assert_close(approx[outside], template_out[outside], atol=0, rtol=0)


@pytest.mark.parametrize("naive", [False, True])
def test_a_block_loader_serves_every_slot(preset, naive):
    """`BlockLoader` over a keys-values record (its `use_cache` one flag per slot) gives the same
    forward as the record itself."""
    inputs = _inputs(preset)
    expected, record = recording_forward(preset, inputs, KV)
    use = [True] * len(record)
    index = token_index(_box_mask(2, 2, 6, 10), 2)
    out = masked_forward(preset, inputs, MaskedPlan(index, BlockLoader(record, use, "cpu", naive), use, KV))
    torch.testing.assert_close(out, expected, **TOL)


def test_a_plan_that_would_need_unmasked_inputs_is_refused(preset):
    index = token_index(_box_mask(0, 0, 2, 2), 2)
    with pytest.raises(ValueError, match="every slot"):
        MaskedPlan(index, [], [True, False, True], KV)
    with pytest.raises(ValueError, match="3 cache slots"):
        masked_forward(preset, _inputs(preset), _plan(index, [], 2))  # one flag per block: the final slot missing


def test_an_outputs_record_is_refused_as_keys_values(preset):
    inputs = _inputs(preset)
    _, outputs = recording_forward(preset, inputs)
    index = token_index(_box_mask(0, 0, 2, 2), 2)
    with pytest.raises(ValueError, match="cached keys and values"):
        masked_forward(preset, inputs, _plan(index, outputs + [outputs[-1]], len(outputs) + 1))


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError):
        MaskedPlan(torch.zeros(1, 1, dtype=torch.long), [], [True], "keys")
