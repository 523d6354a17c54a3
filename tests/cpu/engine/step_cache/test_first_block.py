"""The First-Block Cache's forward (`engine.step_cache`): cut after the first block, the UNet and
SD3 forwards are the models' own bit for bit; a request that skips leaves the later blocks'
batch, one that computes gets exactly its plain forward, whatever its partners decide."""

import pytest
import torch

from stepserve.engine.editing.masked_sd3 import SD3Inputs
from stepserve.engine.step_cache.first_block import FirstBlockCache, SplitForward, first_block_cached
from stepserve.engine.step_cache.split_sd3 import split_sd3
from stepserve.engine.step_cache.split_unet import split_unet


def unet_inputs(family, rows: int, seed: int = 0, side: int = 8):
    g = torch.Generator("cpu").manual_seed(seed)
    unet = family.denoiser
    sample = torch.randn(rows, unet.config.in_channels, side, side, generator=g)
    timesteps = torch.linspace(900, 100, rows)
    context = torch.randn(rows, 77, unet.config.cross_attention_dim, generator=g)
    extra = {}
    if unet.config.addition_embed_type == "text_time":  # SDXL: pooled text and the size ids
        extra = {"added_cond_kwargs": {"text_embeds": torch.randn(rows, 32, generator=g),
                                       "time_ids": torch.tensor([[side * 8, side * 8, 0, 0, side * 8, side * 8]] * rows,
                                                                dtype=torch.float32)}}
    return sample, timesteps, context, extra


def whole(split: SplitForward) -> torch.Tensor:
    first, carry = split.head()
    last = split.body(carry)
    return split.foot(last, carry)


@pytest.mark.parametrize("name", ["tiny_family", "tiny_sdxl"])
def test_the_cut_unet_is_the_unet(name, request):
    family = request.getfixturevalue(name)
    sample, t, context, extra = unet_inputs(family, 3)
    if extra:  # the tiny SDXL's pooled width is its own config's
        width = family.denoiser.add_embedding.linear_1.in_features - 6 * family.denoiser.config.addition_time_embed_dim
        extra["added_cond_kwargs"]["text_embeds"] = torch.randn(3, width)
    with torch.inference_mode():
        expected = family.denoiser(sample, t, encoder_hidden_states=context, return_dict=False, **extra)[0]
        got = whole(split_unet(family.denoiser, sample, t, context, extra.get("added_cond_kwargs")))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def sd3_inputs(family, rows: int, seed: int = 0) -> SD3Inputs:
    g = torch.Generator("cpu").manual_seed(seed)
    config = family.denoiser.config
    return SD3Inputs(torch.randn(rows, config.in_channels, 8, 8, generator=g),
                     torch.randn(rows, 12, config.joint_attention_dim, generator=g),
                     torch.randn(rows, config.pooled_projection_dim, generator=g), torch.linspace(900, 100, rows))


def test_the_cut_sd3_transformer_is_the_transformer(tiny_sd3):
    inputs = sd3_inputs(tiny_sd3, 3)
    with torch.inference_mode():
        expected = tiny_sd3.denoiser(hidden_states=inputs.hidden_states, timestep=inputs.timestep,
                                     encoder_hidden_states=inputs.encoder_hidden_states,
                                     pooled_projections=inputs.pooled_projections, return_dict=False)[0]
        got = whole(split_sd3(tiny_sd3.denoiser, inputs))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class Counting:
    """A split whose body records the rows it ran."""

    def __init__(self, split: SplitForward):
        self.rows: list[int] = []
        self.split = SplitForward(split.head, self.body, split.foot, split.residual)
        self._body = split.body

    def body(self, carry):
        self.rows.append(carry[0].shape[0])
        return self._body(carry)


@pytest.mark.parametrize("dit", [False, True])
def test_a_skipping_request_leaves_the_batch_and_a_computing_one_is_exact(dit, tiny_family, tiny_sd3):
    def split(inputs):
        if dit:
            return split_sd3(tiny_sd3.denoiser, inputs)
        sample, t, context = inputs
        return split_unet(tiny_family.denoiser, sample, t, context)

    def inputs_at(seed):
        if dit:
            return sd3_inputs(tiny_sd3, 4, seed)
        sample, t, context, _ = unet_inputs(tiny_family, 4, seed)
        return sample, t, context

    caching, exact = FirstBlockCache(threshold=1e9, rows=2), FirstBlockCache(threshold=0.0, rows=2)
    with torch.inference_mode():
        for step, seed in enumerate((0, 0, 1)):
            inputs = inputs_at(seed)
            counting = Counting(split(inputs))
            got = first_block_cached(counting.split, [caching, exact])
            plain = whole(split(inputs))
            # The threshold-0 request: its plain forward (up to a smaller batch's float rounding).
            torch.testing.assert_close(got[2:], plain[2:], rtol=1e-4, atol=1e-5)
            if step == 0:  # nothing cached yet: everyone computes, and exactly
                assert counting.rows == [4]
                torch.testing.assert_close(got, plain, rtol=0, atol=0)
            else:  # the caching request skips: the later blocks ran for the other's 2 rows only
                assert counting.rows == [2]
    assert (caching.computed, caching.skipped) == (1, 2) and (exact.computed, exact.skipped) == (3, 0)


def test_an_unchanged_first_block_reuses_its_step_exactly(tiny_sd3):
    """The same inputs twice: the skipped step is the computed one (the residual added back)."""
    cache = FirstBlockCache(threshold=0.01, rows=2)
    inputs = sd3_inputs(tiny_sd3, 2)
    with torch.inference_mode():
        once = first_block_cached(split_sd3(tiny_sd3.denoiser, inputs), [cache])
        again = first_block_cached(split_sd3(tiny_sd3.denoiser, inputs), [cache])
    assert cache.skipped == 1
    torch.testing.assert_close(again, once, rtol=1e-5, atol=1e-5)


def test_a_threshold_is_not_negative():
    with pytest.raises(ValueError, match=">= 0"):
        FirstBlockCache(threshold=-0.1, rows=1)


def scripted(firsts, results):
    """A split whose head gives `firsts[k]` and whose body gives `results[k]` at call k (one row)."""
    calls = iter(range(len(firsts)))

    def head():
        k = next(calls)
        return torch.full((1, 2), float(firsts[k])), torch.tensor([k])

    return SplitForward(head, lambda carry: torch.full((1, 2), float(results[int(carry[0])])),
                        lambda last, carry: last, residual=False)


@pytest.mark.parametrize("order,expected", [(0, 10.0), (1, 20.0)])
def test_taylorseer_extrapolates_what_a_skipped_step_takes(order, expected):
    """Computed at steps 0 and 1 (results 0 and 10); step 2's first block has not moved, so it
    skips: reuse takes 10, TaylorSeer's first order 10 + (2 - 1) * (10 - 0) / (1 - 0) = 20."""
    cache = FirstBlockCache(threshold=0.1, rows=1, order=order)
    split = scripted(firsts=[1.0, 2.0, 2.0], results=[0.0, 10.0, 99.0])
    out = [first_block_cached(split, [cache]) for _ in range(3)]
    assert (cache.computed, cache.skipped) == (2, 1)
    assert [float(o[0, 0]) for o in out] == [0.0, 10.0, expected]
    with pytest.raises(ValueError, match="first order"):
        FirstBlockCache(threshold=0.1, rows=1, order=2)


def test_dropping_the_unconditional_row_keeps_the_conditional_one():
    cache = FirstBlockCache(0.1, rows=2, order=1)
    cache.keep(torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]]))
    cache.drop_unconditional()
    assert cache.rows == 1 and cache.first.tolist() == [[2.0]] and cache.cached.tolist() == [[4.0]]
    assert cache.before is None
    with pytest.raises(ValueError, match="two rows"):
        cache.drop_unconditional()
