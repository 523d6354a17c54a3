"""`stepserve profile` measures tiny-sd3's served masked forwards (mask_ratio < 1 rows) after a
self-record, and the edit pricing fitted to them meets them."""

import argparse
import subprocess
import sys

import pytest
import torch

from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.families import ALL_PARTS, ModelSource, family_class, load_family
from stepserve.engine.template_edits import EditMember, TemplateEdit, template_forward
from stepserve.engine.text_encoding import embed
from stepserve.policies.cost_model import DENOISE, BatchShape, ProfiledCostModel, read_profile
from stepserve.policies.instgenie import MaskAwareCosts, profiled_costs
from stepserve.profiling.common import PROMPT, QUICK, Context, Stopwatch, choose_grid, first_timestep, forward_inputs
from stepserve.profiling.edits import masked_tokens, measure_masked, self_records

GRID = QUICK.__class__(**{**QUICK.__dict__, "repeats": 1, "mask_ratios": (0.25, 0.5)})


@pytest.fixture(scope="module")
def sd3():
    torch.manual_seed(0)
    return load_family(ModelSource("tiny-sd3", "sd3", preset="tiny"), ALL_PARTS, "cpu")


def test_the_timed_forward_is_the_masked_one_over_its_own_record(sd3):
    sample, timesteps, cond = forward_inputs(sd3, embed(sd3, PROMPT), first_timestep(sd3), 4, 64,
                                             torch.Generator("cpu").manual_seed(0))
    for kind in CacheKind:
        records = self_records(sd3, kind, 64, (sample, timesteps, cond), 2, 2)
        assert len(records) == 2 and len(records[0]) == sd3.cache_slots(kind)
        index, tokens = masked_tokens(sd3, 64, 2, 0.25)
        assert tokens == 16 and index.shape == (2, 4)
        members = [EditMember(TemplateEdit("k", kind, index, record), 2) for record in records]
        masked = template_forward(sd3, members, sample, timesteps, cond)
        # Its own record holds what the unmasked tokens would compute: the plain forward's output.
        torch.testing.assert_close(masked, sd3.denoise(sample, timesteps, cond), atol=1e-5, rtol=1e-4)


def test_masked_rows_per_size_edits_and_ratio(sd3):
    ctx = Context("tiny-sd3", "cpu", sd3, GRID, Stopwatch("cpu"), "measured today")
    rows = measure_masked(ctx, CacheKind.OUTPUTS, 1)
    # Edits 1 and 2 of CFG's two rows, at 4 and 8 of the 16 tokens of 64 px.
    assert sorted((r.height, r.rows, r.mask_ratio) for r in rows) == [(64, 2, 0.25), (64, 2, 0.5), (64, 4, 0.25),
                                                                      (64, 4, 0.5)]
    assert all(r.component == DENOISE and r.latency_ms > 0 and "cached outputs" in r.source for r in rows)
    none = Context("tiny-sd3", "cpu", sd3, QUICK.__class__(**{**GRID.__dict__, "mask_ratios": ()}), ctx.watch, "x")
    assert measure_masked(none, CacheKind.OUTPUTS, 1) == []
    sd15 = load_family(ModelSource("tiny-sd", "sd15", preset="tiny"), ALL_PARTS, "cpu")
    assert measure_masked(Context("tiny-sd", "cpu", sd15, GRID, ctx.watch, "x"), CacheKind.OUTPUTS, 1) == []


def test_mask_ratios_come_from_the_command_line_within_zero_and_one():
    args = argparse.Namespace(quick=True, sizes=None, batches=None, repeats=None, mask_ratios=None)
    assert choose_grid(args, "cpu").mask_ratios == (0.1, 0.2, 0.5)
    assert choose_grid(argparse.Namespace(**{**args.__dict__, "mask_ratios": []}), "cpu").mask_ratios == ()
    with pytest.raises(ValueError, match="mask ratios"):
        choose_grid(argparse.Namespace(**{**args.__dict__, "mask_ratios": [0.5, 1.0]}), "cpu")


def test_quick_profile_of_tiny_sd3_writes_masked_rows(tmp_path):
    out = tmp_path / "tiny-sd3-cpu.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "stepserve.cli", "profile", "--config", "configs/local-images.yaml", "--model",
         "tiny-sd3", "--device", "cpu", "--quick", "--out", str(out), "--num-cpus", "2", "--mask-ratios", "0.25",
         "0.5"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_profile(out)
    masked = [r for r in rows if r.component == DENOISE and r.mask_ratio < 1]
    assert sorted((r.rows, r.mask_ratio) for r in masked) == [(2, 0.25), (2, 0.5), (4, 0.25), (4, 0.5)]
    # The loading DP's block costs, of an outputs record whatever the config's kind.
    blocks = ProfiledCostModel.from_csv(out).block_rows  # rows 2 and 4: 2 slots x (C_w at 2 ratios, C_wo, L)
    assert len(blocks) == 2 * 2 * 4 and all("outputs record" in r.source for r in blocks)
    assert all("cached keys_values" in r.source for r in masked)  # local-images.yaml's default cache kind
    assert sorted(r.rows for r in rows if r.component == DENOISE and r.mask_ratio == 1) == [1, 2, 4]
    assert "denoise (masked)     FLOPs line   4 pts" in proc.stdout
    profile = ProfiledCostModel.from_csv(out)
    costs = profiled_costs(profile, {"tiny-sd3": family_class("sd3").dit_dims(
        ModelSource("tiny-sd3", "sd3", preset="tiny"), CacheKind.KEYS_VALUES)})
    assert isinstance(costs, MaskAwareCosts)
    for r in masked:
        assert costs.denoise_seconds(BatchShape("tiny-sd3", 64, 64, r.rows, mask_ratio=r.mask_ratio)) == pytest.approx(
            r.seconds, rel=0.25)


def test_block_rows_per_size_edits_slot_and_ratio_make_the_dps_costs(sd3):
    from stepserve.policies.cost_model import BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD
    from stepserve.policies.instgenie.block_profile import MeasuredBlockCosts
    from stepserve.profiling.edit_blocks import measure_edit_blocks

    ctx = Context("tiny-sd3", "cpu", sd3, GRID, Stopwatch("cpu"), "measured today")
    rows = measure_edit_blocks(ctx, 1)
    slots = sd3.cache_slots(CacheKind.OUTPUTS)
    # C_w per (rows, share, slot) at 4 and 8 of 16 tokens; C_wo and L once per (rows, slot).
    assert sorted((r.rows, r.mask_ratio, r.slot) for r in rows if r.component == BLOCK_CACHED) == [
        (n, share, s) for n in (2, 4) for share in (0.25, 0.5) for s in range(slots)]
    for component in (BLOCK_FULL, BLOCK_LOAD):
        assert sorted((r.rows, r.slot) for r in rows if r.component == component) == [
            (n, s) for n in (2, 4) for s in range(slots)]
    assert all(r.latency_ms > 0 for r in rows if r.component != BLOCK_LOAD)
    assert all(r.latency_ms == 0 for r in rows if r.component == BLOCK_LOAD)  # CPU: the record is read in place
    costs = MeasuredBlockCosts.from_rows(rows).at("tiny-sd3", 64, 64, 3, 0.3)
    assert costs is not None and all(len(part) == slots for part in costs)
    sd15 = load_family(ModelSource("tiny-sd", "sd15", preset="tiny"), ALL_PARTS, "cpu")
    assert measure_edit_blocks(Context("tiny-sd", "cpu", sd15, GRID, ctx.watch, "x"), 1) == []
