"""Profiles with masked forwards: the mask_ratio column (written, read, optional), full fits left
as they were, and the edit pricing fitted to the masked rows (Fig. 11's FLOPs line)."""

from __future__ import annotations

import math
import random

import pytest

from stepserve.policies import cost_model as cm
from stepserve.policies.cost_model import (
    DENOISE,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    BatchShape,
    ProfiledCostModel,
    ProfileError,
    ProfileRow,
    load_profile,
    read_profile,
    write_profile,
)
from stepserve.policies.instgenie import (
    DiTDims,
    LinearFit,
    MaskAwareCosts,
    fitted_edit_models,
    forward_flops,
    profiled_costs,
)

M = "sd3"
# SD3-medium's transformer with a keys-values cache: 24 blocks, hidden 1536, 77 + 256 text tokens.
DIMS = (DiTDims(24, 1536, patch=2, text_tokens=333, keys_values=True),)
LINE = LinearFit(0.004, 2.5e-15)  # the masked forward's seconds by its FLOPs
FULL_FIXED_S = 0.006
SIZES = (512, 768, 1024)
RATIOS = (0.1, 0.2, 0.5)


def row(component, ms, height=0, width=0, rows=1, mask_ratio=1.0, **extra):
    return ProfileRow(M, "cuda", component, height, width, rows, extra.pop("frames", 1), ms, 5, "synthetic",
                      extra.pop("sp_degree", 1), mask_ratio)


def full_rows():
    out = [row(DENOISE, 1e3 * (FULL_FIXED_S + LINE.slope * forward_flops(DIMS, s, s, r)), s, s, r)
           for s in SIZES for r in (1, 2, 4, 8, 16)]
    out += [row(TEXT_ENCODE, 5.0 + n, rows=n) for n in (1, 2, 4)]
    out += [row(VAE_DECODE, 1e-4 * s * s, s, s) for s in SIZES]
    return out + [row(ROUND_OVERHEAD, 1.0)]


def masked_rows(noise=0.02, seed=0):
    """Served masked forwards on the line, each within `noise` of it."""
    rng = random.Random(seed)
    return [row(DENOISE, 1e3 * LINE(forward_flops(DIMS, s, s, r, m)) * rng.uniform(1 - noise, 1 + noise), s, s, r, m)
            for s in SIZES for r in (2, 8, 16) for m in RATIOS]


def test_the_column_round_trips_and_old_files_still_read(tmp_path):
    rows = full_rows() + masked_rows()
    path = tmp_path / "p.csv"
    write_profile(path, rows)
    lines = path.read_text().splitlines()
    assert lines[0].endswith(",sp_degree,mask_ratio,groups,slot") and lines[0] == ",".join(cm.CSV_COLUMNS)
    assert lines[1].endswith(",1,1,,")  # full forwards first, at ratio 1 (of one resolution: no groups, no slot)
    back = read_profile(path)
    assert sorted(back, key=repr) == sorted(
        [ProfileRow(**{**r.__dict__, "latency_ms": round(r.latency_ms, 4)}) for r in rows], key=repr)
    assert {r.mask_ratio for r in back} == {1.0, *RATIOS}
    # A profile written before the column (and before sp_degree): every row a full forward.
    old = tmp_path / "old.csv"
    old.write_text("model,device,component,height,width,rows,frames,latency_ms,samples,source\n"
                   "sd3,cuda,denoise,512,512,1,1,20.0,3,x\nsd3,cuda,denoise,512,512,2,1,30.0,3,x\n")
    assert [(r.mask_ratio, r.sp_degree) for r in read_profile(old)] == [(1.0, 1), (1.0, 1)]
    assert ProfiledCostModel.from_csv(old).masked_rows == ()
    assert load_profile("tiny-flux-cpu").masked_rows == ()  # a shipped profile of the old form
    assert len(load_profile("tiny-sd3-cpu").masked_rows) == 27  # 3 sizes x 1, 4, 8 edits x 3 ratios


@pytest.mark.parametrize("bad", [dict(mask_ratio=0.0), dict(mask_ratio=1.5), dict(mask_ratio=math.nan),
                                 dict(component=VAE_DECODE, mask_ratio=0.5), dict(sp_degree=2, mask_ratio=0.5),
                                 dict(frames=9, mask_ratio=0.5)])
def test_a_masked_row_is_an_image_forward_on_one_worker(bad):
    with pytest.raises(ProfileError, match="mask_ratio"):
        row(bad.pop("component", DENOISE), 10.0, 512, 512, 2, **bad)


def test_the_profile_fits_full_forwards_as_before_and_keeps_the_masked_ones_aside():
    plain, both = ProfiledCostModel(full_rows()), ProfiledCostModel(full_rows() + masked_rows())
    assert plain.masked_rows == () and sorted(both.masked_rows, key=repr) == sorted(masked_rows(), key=repr)
    for size in (256, 512, 640, 1024, 1280):
        for rows in (1, 3, 16, 24):
            for ratio in (1.0, 0.2):  # a profile prices the full forward whatever the mask
                shape = BatchShape(M, size, size, rows, mask_ratio=ratio)
                assert both.denoise_seconds(shape) == plain.denoise_seconds(shape)
                assert both.step_seconds(shape) == plain.step_seconds(shape)
    assert both.fit_report() == plain.fit_report()


def test_the_fitted_line_meets_the_measured_points_below_the_full_forward():
    profile = ProfiledCostModel(full_rows() + masked_rows())
    costs = profiled_costs(profile, {M: DIMS})
    assert isinstance(costs, MaskAwareCosts) and set(costs.edits) == {M}
    line = costs.edits[M].compute
    assert line.points == len(masked_rows()) and line.r2 > 0.99
    assert line.slope == pytest.approx(LINE.slope, rel=0.05)
    for r in masked_rows():
        masked = BatchShape(M, r.height, r.width, r.rows, mask_ratio=r.mask_ratio)
        assert costs.denoise_seconds(masked) == pytest.approx(r.seconds, rel=0.05)
        full = BatchShape(M, r.height, r.width, r.rows)
        assert costs.denoise_seconds(masked) < costs.denoise_seconds(full) == profile.denoise_seconds(full)
        assert costs.step_seconds(masked) == pytest.approx(costs.denoise_seconds(masked) + 1e-3)
    # Between the measured points too, and more masked tokens never cost less.
    between = [costs.denoise_seconds(BatchShape(M, 640, 640, 6, mask_ratio=m)) for m in (0.05, 0.15, 0.3, 0.7)]
    assert between == sorted(between)
    assert between[1] == pytest.approx(LINE(forward_flops(DIMS, 640, 640, 6, 0.15)), rel=0.05)


def test_without_masked_rows_or_dimensions_the_profile_is_the_cost_model():
    plain = ProfiledCostModel(full_rows())
    assert profiled_costs(plain, {M: DIMS}) is plain
    both = ProfiledCostModel(full_rows() + masked_rows())
    assert profiled_costs(both, {}) is both  # no model edits with cached activations
    assert profiled_costs(both, {"other": DIMS}) is both
    one = ProfiledCostModel(full_rows() + masked_rows()[:1])  # one point makes no line
    with pytest.raises(ProfileError, match="no line"):
        fitted_edit_models(one.masked_rows, {M: DIMS})


def test_a_keys_values_cache_leaves_unmasked_tokens_nothing_to_compute_and_twice_the_bytes():
    outputs, kv = DiTDims(1, 64, text_tokens=0), DiTDims(1, 64, text_tokens=0, keys_values=True)
    tokens = 256
    assert kv.block_flops(tokens, 2, 0.0) == 0.0 and outputs.block_flops(tokens, 2, 0.0) == 2 * tokens * 4 * 64 * 64
    assert kv.block_flops(tokens, 2, 1.0) == outputs.block_flops(tokens, 2, 1.0)
    assert kv.block_flops(tokens, 2, 0.3) == pytest.approx(0.3 * kv.block_flops(tokens, 2, 1.0))
    assert kv.block_bytes(tokens, 2, 0.25) == 2 * outputs.block_bytes(tokens, 2, 0.25)


def test_a_masked_batch_split_over_workers_computes_in_full():
    profile = ProfiledCostModel(full_rows() + masked_rows())
    costs = profiled_costs(profile, {M: DIMS})
    split = BatchShape(M, 1024, 1024, 2, cfg_split=True, mask_ratio=0.2)
    assert costs.denoise_seconds(split) == profile.denoise_seconds(split)  # the worker runs the plain forward
    assert costs.step_seconds(BatchShape(M, 1024, 1024, 2, sp_degree=2, mask_ratio=0.2)) == math.inf
