"""The patch-cached SD3 forward on the tiny transformer (a dual-attention block, then the last
block): computing every patch is the model's own forward bit for bit; reused patches take their
cached outputs; recomputed ones are computed right among them; requests in one batch keep their
own caches, and a batch's tensors go once its members have moved on."""

import math
import weakref

import pytest
import torch

from stepserve.engine.editing.masked_sd3 import SD3Inputs, unpatchify
from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse, patch_cached_forward, statistics_forward
from stepserve.engine.patch_cache.predictor import ReusePredictor
from stepserve.engine.patch_cache.statistics import ReuseStatistics

from tests.tiny import TINY_SD3

LATENT = 16  # 8 x 8 tokens of patch 2
SIDE = 2  # 4 x 4 cache patches of 2 x 2 tokens
PATCHES = 16
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def transformer():
    return load_family(TINY_SD3, {DENOISER}, "cpu").denoiser


def _blocks(transformer) -> int:
    return len(transformer.transformer_blocks)


def _rule(transformer, bias: float, change_weight: float = 0.0, noise_weight: float = 0.0) -> PatchReuse:
    return PatchReuse(ReusePredictor(change_weight, noise_weight, (bias,) * _blocks(transformer), 1e-3), side=SIDE)


def _never(transformer) -> PatchReuse:
    return _rule(transformer, -math.inf)


def _always(transformer) -> PatchReuse:
    return _rule(transformer, math.inf)


def _below(transformer, threshold: float) -> PatchReuse:
    """Reuse a patch whose input changed by less than `threshold` (relative MSE)."""
    return _rule(transformer, math.log10(threshold), change_weight=-1.0)


def _inputs(transformer, rows: int, seed: int, timestep: float = 500.0) -> SD3Inputs:
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    return SD3Inputs(torch.randn(rows, cfg.in_channels, LATENT, LATENT, generator=g),
                     torch.randn(rows, 7, cfg.joint_attention_dim, generator=g),
                     torch.randn(rows, cfg.pooled_projection_dim, generator=g), torch.full((rows,), timestep))


def _trajectory(transformer, rows: int, seed: int, steps: int) -> list[SD3Inputs]:
    """Inputs of consecutive steps: the left half of the latents moves a little each step, the
    right half a lot, so some patches are worth reusing and others not."""
    first = _inputs(transformer, rows, seed, timestep=900.0)
    g = torch.Generator().manual_seed(seed + 100)
    out, latents = [first], first.hidden_states
    for step in range(1, steps):
        move = torch.randn(latents.shape, generator=g)
        move[..., : LATENT // 2] *= 1e-3
        latents = latents + move
        out.append(SD3Inputs(latents, first.encoder_hidden_states, first.pooled_projections,
                             torch.full((rows,), 900.0 - 100 * step)))
    return out


def _reference(transformer, inputs: SD3Inputs) -> torch.Tensor:
    with torch.inference_mode():
        return transformer(hidden_states=inputs.hidden_states, encoder_hidden_states=inputs.encoder_hidden_states,
                           pooled_projections=inputs.pooled_projections, timestep=inputs.timestep,
                           return_dict=False)[0]


def _joined(*parts: SD3Inputs) -> SD3Inputs:
    return SD3Inputs(*(torch.cat([getattr(p, name) for p in parts]) for name in
                       ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")))


def test_computing_every_patch_is_the_model_forward_bit_for_bit(transformer):
    """The first step (nothing cached), and every step of a predictor that never reuses, run the
    plain blocks: exactly `transformer(...)`; so does the forward that records statistics."""
    cache, recorded = PatchCache(rows=2), PatchCache(rows=2)
    statistics = ReuseStatistics()
    for step, inputs in enumerate(_trajectory(transformer, 2, seed=0, steps=3)):
        expected = _reference(transformer, inputs)
        assert torch.equal(patch_cached_forward(transformer, inputs, [cache], _never(transformer)), expected)
        fresh = PatchCache(rows=2)
        assert torch.equal(statistics_forward(transformer, inputs, [fresh], [[recorded]] if step else [[]], SIDE,
                                              statistics), expected)
        recorded = fresh
    assert cache.steps == 3 and int(cache.reused.sum()) == 0 and cache.reuse_share() == 0.0
    samples = statistics.samples()
    assert len(samples) == 2 * _blocks(transformer) * 2 * PATCHES  # steps 2 and 3, every block, row and patch


def test_a_predictor_that_always_reuses_takes_the_cached_outputs(transformer):
    """After step 1, every patch is reused: the last block is skipped and the prediction is the
    output layer over step 1's cached last-block output; earlier blocks compute their text
    stream and one token a row (token 0), every other token comes from the cache."""
    first, second = _trajectory(transformer, 2, seed=1, steps=2)
    cache, reuse = PatchCache(rows=2), _always(transformer)
    patch_cached_forward(transformer, first, [cache], reuse)
    inputs_before, outputs_before = list(cache.inputs), list(cache.outputs)
    out = patch_cached_forward(transformer, second, [cache], reuse)

    with torch.inference_mode():
        temb = transformer.time_text_embed(second.timestep, second.pooled_projections)
        tokens = transformer.proj_out(transformer.norm_out(outputs_before[-1], temb))
    expected = unpatchify(tokens, LATENT, LATENT, transformer.config.patch_size, transformer.out_channels)
    assert torch.equal(out, expected)
    assert cache.outputs[-1] is outputs_before[-1] and cache.inputs[-1] is inputs_before[-1]
    for before, after in zip(outputs_before[:-1], cache.outputs[:-1]):
        assert torch.equal(after[:, 1:], before[:, 1:])
    assert cache.reused.tolist() == [2 * PATCHES] * _blocks(transformer)
    assert cache.reuse_share() == 0.5  # step 1 computed everything


def test_recomputed_patches_among_reused_ones_are_exact(transformer):
    """The same inputs twice, with some patches' cached inputs spoiled so the predictor sends
    them to be recomputed: the reused patches' cached outputs are what would be computed, so the
    masked blocks (rows padded to different counts) must give the plain forward."""
    inputs = _inputs(transformer, rows=2, seed=2)
    cache = PatchCache(rows=2)
    reuse = _below(transformer, 1e-6)
    expected = patch_cached_forward(transformer, inputs, [cache], reuse)
    tokens = torch.arange(64).reshape(8, 8)
    spoiled = {0: tokens[:2, :4].flatten(), 1: tokens[4:, 2:6].flatten()}  # row 0: 2 patches, row 1: 4
    for b in range(_blocks(transformer)):
        for row, index in spoiled.items():
            cache.inputs[b] = cache.inputs[b].clone()
            cache.inputs[b][row, index] += 1.0
    out = patch_cached_forward(transformer, inputs, [cache], reuse)
    torch.testing.assert_close(out, expected, **TOL)
    assert cache.reused.tolist() == [2 * PATCHES - 6] * _blocks(transformer)
    for b in range(_blocks(transformer)):  # the recomputed patches' inputs are this step's again
        assert cache.inputs[b][0, spoiled[0]].abs().max() < 1e3 and not cache.inputs[b].isnan().any()
    torch.testing.assert_close(patch_cached_forward(transformer, inputs, [cache], reuse), expected, **TOL)
    assert cache.reused.tolist() == [4 * PATCHES - 6] * _blocks(transformer)  # nothing spoiled any more


def test_reuse_changes_the_result_modestly(transformer):
    """Reusing slowly moving patches: close to the exact forward, not equal to it, and far
    closer than the previous step's prediction is."""
    cache, reuse = PatchCache(rows=2), _below(transformer, 1e-3)
    steps = _trajectory(transformer, 2, seed=3, steps=3)
    for inputs in steps:
        out = patch_cached_forward(transformer, inputs, [cache], reuse)
    exact, previous = _reference(transformer, steps[-1]), _reference(transformer, steps[-2])
    error = (out - exact).norm() / exact.norm()
    assert 0 < error < 0.2 * (previous - exact).norm() / exact.norm()
    assert 0 < int(cache.reused.sum()) < 2 * 2 * PATCHES * _blocks(transformer)


def test_requests_in_one_batch_keep_their_own_caches(transformer):
    """A (1 row) steps alone, then with B (2 rows), which joins with nothing cached: every row
    equals its request run alone, and each cache counts only its own reuse."""
    reuse = _below(transformer, 1e-3)
    a_steps, b_steps = _trajectory(transformer, 1, seed=4, steps=3), _trajectory(transformer, 2, seed=5, steps=2)

    alone_a, alone_b = PatchCache(rows=1), PatchCache(rows=2)
    a_out = [patch_cached_forward(transformer, x, [alone_a], reuse) for x in a_steps]
    b_out = [patch_cached_forward(transformer, x, [alone_b], reuse) for x in b_steps]

    a, b = PatchCache(rows=1), PatchCache(rows=2)
    torch.testing.assert_close(patch_cached_forward(transformer, a_steps[0], [a], reuse), a_out[0], atol=0, rtol=0)
    for step in (1, 2):
        out = patch_cached_forward(transformer, _joined(a_steps[step], b_steps[step - 1]), [a, b], reuse)
        torch.testing.assert_close(out[:1], a_out[step], **TOL)
        torch.testing.assert_close(out[1:], b_out[step - 1], **TOL)
    assert a.reused.tolist() == alone_a.reused.tolist() and b.reused.tolist() == alone_b.reused.tolist()
    assert int(a.reused.sum()) > 0 and int(b.reused.sum()) > 0
    assert (a.steps, b.steps) == (3, 2)


def test_each_request_owns_its_entries(transformer):
    """Alone, a request keeps the forward's tensors; in a batch, a copy of its rows, so nothing
    of a request that leaves stays behind in its partners' caches."""
    reuse = _below(transformer, 1e-3)
    a, b = PatchCache(rows=1), PatchCache(rows=2)
    patch_cached_forward(transformer, _inputs(transformer, rows=3, seed=6), [a, b], reuse)
    for cache in (a, b):
        for t in cache.inputs + cache.outputs:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    entries = [weakref.ref(t) for t in a.inputs + a.outputs]
    del a
    assert all(ref() is None for ref in entries)


def test_refuses_mismatched_rows_sizes_and_predictors(transformer):
    inputs = _inputs(transformer, rows=2, seed=7)
    with pytest.raises(ValueError, match="2 rows"):
        patch_cached_forward(transformer, inputs, [PatchCache(rows=1)], _never(transformer))
    cache = PatchCache(rows=2)
    patch_cached_forward(transformer, inputs, [cache], _never(transformer))
    smaller = SD3Inputs(inputs.hidden_states[..., :8, :8], inputs.encoder_hidden_states, inputs.pooled_projections,
                        inputs.timestep)
    with pytest.raises(ValueError, match="16 tokens"):
        patch_cached_forward(transformer, smaller, [cache], _never(transformer))
    wrong = PatchReuse(ReusePredictor(0.0, 0.0, (0.0,) * 3, 1e-3), side=SIDE)
    with pytest.raises(ValueError, match="3 blocks"):
        patch_cached_forward(transformer, inputs, [cache], wrong)
