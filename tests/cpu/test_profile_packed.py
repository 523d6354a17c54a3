"""`stepserve profile` times the forward a packing worker serves for mixes of its grid's sizes
(tiny SD3's packed tokens, tiny SD1.5's patched UNet) and reports how the packed pricing meets it."""

import pytest
import torch

from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.policies.cost_model import DENOISE, ProfiledCostModel, read_profile, write_profile
from stepserve.profiling.common import QUICK, Context, Stopwatch
from stepserve.profiling.images import measure_denoise
from stepserve.profiling.packed import measure_packed, packed_fit_report, size_mixes

GRID = QUICK.__class__(**{**QUICK.__dict__, "sizes": (64, 128), "batches": (1, 2), "repeats": 1,
                          "packed_batches": (1, 2)})


def test_mixes_are_every_set_of_two_or_more_sizes():
    assert size_mixes((256, 64, 128, 64)) == [(64, 128), (64, 256), (128, 256), (64, 128, 256)]
    assert size_mixes((64,)) == []


@pytest.mark.parametrize("name, family", [("tiny-sd3", "sd3"), ("tiny-sd", "sd15")])
def test_packed_rows_per_mix_and_requests_and_their_fit_report(tmp_path, name, family):
    torch.manual_seed(0)
    model = load_family(ModelSource(name, family, preset="tiny"), ALL_PARTS, "cpu")
    ctx = Context(name, "cpu", model, GRID, Stopwatch("cpu"), "measured today")
    rows = measure_packed(ctx, 1)
    # One mix (64 + 128 px) at 1 and 2 CFG requests of each size.
    assert [(r.groups, r.height, r.rows) for r in rows] == [
        (((64, 64, 2), (128, 128, 2)), 128, 4), (((64, 64, 4), (128, 128, 4)), 128, 8)]
    assert all(r.component == DENOISE and r.latency_ms > 0 and "in turn" in r.source for r in rows)
    write_profile(tmp_path / "p.csv", measure_denoise(ctx, 1) + rows)
    profile = ProfiledCostModel(read_profile(tmp_path / "p.csv"))
    assert len(profile.packed_rows) == 2
    report = packed_fit_report(profile, GRID.sizes)
    assert report.startswith(f"  {name} denoise (packed) 2 pts") and "held-out n/a" in report
    # The Throughput Analyzer on the 8 measured batches (2 sizes x 3 rows, 2 packed): 2 held out.
    assert f"\n  {name} throughput analyzer: trained on 6 measured + " in report
    assert "held-out error on 2 measured batches" in report


def test_no_packed_rows_where_the_grid_has_one_size_or_no_packed_batches():
    torch.manual_seed(0)
    sd = load_family(ModelSource("tiny-sd", "sd15", preset="tiny"), ALL_PARTS, "cpu")
    watch = Stopwatch("cpu")
    one_size = QUICK.__class__(**{**GRID.__dict__, "sizes": (64,)})
    assert measure_packed(Context("tiny-sd", "cpu", sd, one_size, watch, "x"), 1) == []
    assert measure_packed(Context("tiny-sd", "cpu", sd, QUICK.__class__(**{**GRID.__dict__, "packed_batches": ()}),
                                  watch, "x"), 1) == []
