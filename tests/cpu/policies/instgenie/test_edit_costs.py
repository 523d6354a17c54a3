"""The edit cost model: Table 1's FLOPs and bytes, the fitted lines, per-block costs, and the
`CostModel` that prices cached activations on top of a profile."""

from __future__ import annotations

import random

import pytest

from stepserve.policies.cost_model import BatchShape, ProfiledCostModel, ProfileRow
from stepserve.policies.instgenie import (
    DiTDims,
    EditCostModel,
    LinearFit,
    Loading,
    MaskAwareCosts,
    fit_line,
    forward_flops,
)
from stepserve.policies.types import RequestKind, RequestSpec

FLUX = DiTDims(57, 3072, patch=2, text_tokens=512)
LINE = LinearFit(0.03, 1.6e-15)
MODEL = "m"


def test_fit_line_recovers_a_known_line_and_reports_r2():
    rng = random.Random(0)
    xs = [rng.uniform(1e12, 2e14) for _ in range(40)]
    exact = fit_line([(x, 0.035 + 1.6e-15 * x) for x in xs])
    assert exact.intercept == pytest.approx(0.035) and exact.slope == pytest.approx(1.6e-15)
    assert exact.r2 == pytest.approx(1.0) and exact.points == 40
    noisy = fit_line([(x, (0.035 + 1.6e-15 * x) * rng.uniform(0.97, 1.03)) for x in xs])
    assert noisy.slope == pytest.approx(1.6e-15, rel=0.05)
    assert 0.98 < noisy.r2 < 1.0
    with pytest.raises(ValueError):
        fit_line([(1.0, 2.0), (1.0, 3.0)])


def test_table1_flops_scale_with_the_mask_except_k_and_v():
    tokens, h = FLUX.tokens(1024, 1024), FLUX.hidden
    assert tokens == 4096
    plain = DiTDims(1, h, text_tokens=0)
    # At m = 1: Q, K, V, O (8 L H^2), feed-forward (16 L H^2), attention (4 L^2 H).
    assert plain.block_flops(tokens, 1, 1.0) == pytest.approx(24 * tokens * h * h + 4 * tokens * tokens * h)
    # At m = 0 only K and V of every token remain.
    assert plain.block_flops(tokens, 1, 0.0) == pytest.approx(4 * tokens * h * h)
    # Linear in m, and in rows.
    f = [FLUX.block_flops(tokens, 3, m) for m in (0.0, 0.5, 1.0)]
    assert f[1] == pytest.approx((f[0] + f[2]) / 2)
    assert FLUX.block_flops(tokens, 3, 0.3) == pytest.approx(3 * FLUX.block_flops(tokens, 1, 0.3))
    # Flux at 1024 px: about 74 TFLOPs a forward (2 x ~12B parameters x 4608 tokens, plus attention).
    assert forward_flops((FLUX,), 1024, 1024, 1) == pytest.approx(7.44e13, rel=0.01)
    # Cached bytes: (1 - m) L H values of 2 bytes per row (Table 1's cache shape).
    assert FLUX.block_bytes(tokens, 2, 0.25) == pytest.approx(2 * 0.75 * tokens * h * 2)


def test_block_costs_spread_the_line_over_the_blocks():
    edits = EditCostModel((FLUX,), LINE, LinearFit.bandwidth(25e9, 1e-5))
    costs = edits.block_costs(1024, 1024, 2, 0.2)
    assert len(costs.with_cache) == len(costs.without_cache) == len(costs.load) == 57
    assert sum(costs.without_cache) == pytest.approx(LINE(edits.flops(1024, 1024, 2, 1.0)))
    assert sum(costs.with_cache) == pytest.approx(LINE(edits.flops(1024, 1024, 2, 0.2)))
    assert costs.load[0] == pytest.approx(1e-5 + FLUX.block_bytes(4096, 2, 0.2) / 25e9)
    assert edits.seconds(1024, 1024, 2, 0.2, Loading.IDEAL) == pytest.approx(sum(costs.with_cache))
    assert edits.seconds(1024, 1024, 2, 1.0) == pytest.approx(sum(costs.without_cache))
    by = {loading: edits.seconds(1024, 1024, 2, 0.2, loading) for loading in Loading}
    assert by[Loading.IDEAL] <= by[Loading.OPTIMAL] <= by[Loading.ALGORITHM1] <= by[Loading.ALWAYS_LOAD]
    assert by[Loading.ALWAYS_LOAD] <= by[Loading.NAIVE]


def test_stages_of_different_blocks_add_up():
    sdxl = (DiTDims(10, 640, patch=2, text_tokens=77), DiTDims(60, 1280, patch=4, text_tokens=77))
    edits = EditCostModel(sdxl, LINE, LinearFit.bandwidth(10e9))
    costs = edits.block_costs(1024, 1024, 2, 0.3)
    assert edits.blocks == 70 and len(set(costs.load)) == 2
    assert costs.load[0] == pytest.approx(2 * 0.7 * 4096 * 640 * 2 / 10e9)
    assert costs.load[-1] == pytest.approx(2 * 0.7 * 1024 * 1280 * 2 / 10e9)


def test_fitted_recovers_the_compute_line_from_profiled_forwards():
    edits = EditCostModel((FLUX,), LINE, LinearFit.bandwidth(25e9))
    samples = [(BatchShape(MODEL, 1024, 1024, rows, mask_ratio=m), LINE(edits.flops(1024, 1024, rows, m)))
               for rows in (1, 2, 4, 8) for m in (0.1, 0.3, 1.0)]
    fitted = EditCostModel.fitted((FLUX,), samples, edits.load)
    assert fitted.compute.intercept == pytest.approx(LINE.intercept)
    assert fitted.compute.slope == pytest.approx(LINE.slope)
    assert fitted.compute.r2 == pytest.approx(1.0) and fitted.compute.points == 12


def base_profile():
    rows = [ProfileRow(MODEL, "gpu", "denoise", 1024, 1024, n, 1, 1e3 * LINE(forward_flops((FLUX,), 1024, 1024, n)),
                       1, "test") for n in range(1, 9)]
    rows += [ProfileRow(MODEL, "gpu", "round_overhead", 0, 0, 1, 1, 1.0, 1, "test"),
             ProfileRow(MODEL, "gpu", "text_encode", 0, 0, 1, 1, 20.0, 1, "test"),
             ProfileRow(MODEL, "gpu", "vae_decode", 1024, 1024, 1, 1, 100.0, 1, "test"),
             ProfileRow(MODEL, "gpu", "lora", 1024, 1024, 1, 1, 5.0, 1, "test"),
             ProfileRow(MODEL, "gpu", "lora", 1024, 1024, 4, 1, 8.0, 1, "test")]
    return ProfiledCostModel(rows)


def test_mask_aware_costs_price_cached_forwards_by_the_edit_model_and_the_rest_by_the_profile():
    base = base_profile()
    edits = EditCostModel((FLUX,), LINE, LinearFit.bandwidth(25e9))
    costs = MaskAwareCosts(base, {MODEL: edits})
    full = BatchShape(MODEL, 1024, 1024, 3)
    cached = BatchShape(MODEL, 1024, 1024, 3, mask_ratio=0.2)
    assert costs.denoise_seconds(full) == base.denoise_seconds(full)
    assert base.denoise_seconds(cached) == base.denoise_seconds(full)  # a profile knows no masks
    assert costs.denoise_seconds(cached) == pytest.approx(edits.seconds(1024, 1024, 3, 0.2), rel=1e-6)
    assert costs.step_seconds(cached) == pytest.approx(costs.denoise_seconds(cached) + 1e-3)
    assert costs.round_seconds([cached, full]) == pytest.approx(
        base.round_seconds([cached, full]) - (base.denoise_seconds(full) - costs.denoise_seconds(cached)))
    # Add-ons cost on top of the cached forward what they cost on top of the full one.
    with_lora = BatchShape(MODEL, 1024, 1024, 3, lora_rows=3, mask_ratio=0.2)
    assert costs.denoise_seconds(with_lora) - costs.denoise_seconds(cached) == pytest.approx(
        base.denoise_seconds(BatchShape(MODEL, 1024, 1024, 3, lora_rows=3)) - base.denoise_seconds(full))
    # The rest is the profile's, the optional parts included.
    assert costs.decode_seconds(MODEL, 1024, 1024) == base.decode_seconds(MODEL, 1024, 1024)
    assert costs.lora_load_seconds(MODEL) == base.lora_load_seconds(MODEL)
    # A model with no edit model computes its edits in full.
    assert MaskAwareCosts(base, {}).denoise_seconds(cached) == base.denoise_seconds(full)


def spec(rid, mask_ratio=1.0, template=None, kind=RequestKind.EDIT, guidance=1.0):
    return RequestSpec(rid, MODEL, "p", 1024, 1024, 28, guidance, 0, kind=kind, mask_ratio=mask_ratio,
                       template_id=template)


def test_a_batch_shape_counts_cached_rows_at_their_ratio_and_the_rest_in_full():
    assert BatchShape.of([spec("a", 0.2, "t")]).mask_ratio == pytest.approx(0.2)
    assert BatchShape.of([spec("a", 0.2)]).mask_ratio == 1.0  # no template: nothing cached
    assert not BatchShape.of([spec("a", kind=RequestKind.T2I)]).uses_cache
    # Rows weigh: a CFG edit (2 rows at 0.1) with a one-row generation (1.0).
    mixed = BatchShape.of([spec("a", 0.1, "t", guidance=5.0), spec("b", kind=RequestKind.T2I)])
    assert mixed.rows == 3 and mixed.mask_ratio == pytest.approx((2 * 0.1 + 1.0) / 3) and mixed.uses_cache
    with pytest.raises(ValueError):
        BatchShape(MODEL, 64, 64, 1, mask_ratio=1.5)
