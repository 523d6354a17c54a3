"""Packed forwards in a profile: the `groups` column, kept out of the one-resolution fits, and the
packed pricing fitted to them."""

from __future__ import annotations

import pytest

from stepserve.policies.cost_model import (
    DENOISE, BatchShape, ProfiledCostModel, ProfileError, ProfileRow, read_profile, write_profile,
)
from stepserve.policies.patchedserve import PackedForwardCosts, PackingFit, packing_fits, packing_report
from stepserve.policies.patchedserve.packed_profile import fit_packing, packed_points

from tests.cpu.policies.patchedserve.fakes import LinearCosts

SIZES = (64, 128)


def one_resolution_rows(costs: LinearCosts) -> list[ProfileRow]:
    return [ProfileRow("sd", "cpu", DENOISE, size, size, rows, 1,
                       costs.denoise_seconds(BatchShape("sd", size, size, rows)) * 1e3, 3, "test")
            for size in SIZES for rows in (1, 2, 4, 8, 16)]


def packed_row(groups, ms: float) -> ProfileRow:
    largest = max(groups, key=lambda g: g[0] * g[1])
    return ProfileRow("sd", "cpu", DENOISE, largest[0], largest[1], sum(g[2] for g in groups), 1, ms, 3, "test",
                      groups=tuple(groups))


MIXES = [((64, 64, n), (128, 128, m)) for n, m in ((2, 2), (4, 2), (2, 8), (8, 8))]


def measured(truth: PackingFit, base: LinearCosts) -> list[ProfileRow]:
    """Packed rows as a device that packs by `truth` would measure them."""
    pricing = PackedForwardCosts(base)
    rows = []
    for mix in MIXES:
        batches = [BatchShape("sd", h, w, n) for h, w, n in mix]
        seconds = truth.seconds(pricing.estimate_seconds(batches), sum(base.denoise_seconds(b) for b in batches))
        rows.append(packed_row(mix, seconds * 1e3))
    return rows


def test_groups_round_trip_through_the_csv_and_stay_out_of_the_one_resolution_fit(tmp_path):
    base = LinearCosts()
    plain = one_resolution_rows(base)
    packed = measured(PackingFit(0.0, 1.3), base)
    write_profile(tmp_path / "p.csv", plain + packed)
    read = read_profile(tmp_path / "p.csv")
    def key(row):
        return row.groups, row.height, row.rows, round(row.latency_ms, 3)

    assert sorted(map(key, read)) == sorted(map(key, plain + packed))
    assert "2@64x64+2@128x128" in (tmp_path / "p.csv").read_text()
    profile = ProfiledCostModel(read)
    assert sorted(map(key, profile.packed_rows)) == sorted(map(key, packed))
    # The packed rows are far dearer than one forward of their largest group's rows: fitted with
    # them, the one-resolution fit would not meet its own points.
    assert profile.denoise_seconds(BatchShape("sd", 128, 128, 10)) == pytest.approx(0.01 + 0.02 * 10, rel=1e-3)


def test_a_profile_without_the_groups_column_still_loads(tmp_path):
    write_profile(tmp_path / "p.csv", one_resolution_rows(LinearCosts()))
    lines = (tmp_path / "p.csv").read_text().splitlines()
    # Written before the groups column (and the slot column after it) existed.
    (tmp_path / "old.csv").write_text("\n".join(line.rsplit(",", 2)[0] for line in lines) + "\n")
    assert "groups" not in (tmp_path / "old.csv").read_text()
    assert ProfiledCostModel(read_profile(tmp_path / "old.csv")).packed_rows == ()


@pytest.mark.parametrize("groups, match", [
    (((64, 64, 2),), "two or more groups"),
    (((64, 64, 2), (64, 64, 4)), "distinct sizes"),
    (((64, 64, 0), (128, 128, 4)), "positive rows"),
])
def test_malformed_groups_are_refused(groups, match):
    with pytest.raises(ProfileError, match=match):
        ProfileRow("sd", "cpu", DENOISE, 128, 128, sum(g[2] for g in groups), 1, 5.0, 3, "t", groups=groups)


def test_a_packed_row_names_its_largest_group_and_all_rows():
    with pytest.raises(ProfileError, match="largest group"):
        ProfileRow("sd", "cpu", DENOISE, 64, 64, 6, 1, 5.0, 3, "t", groups=((64, 64, 2), (128, 128, 4)))
    with pytest.raises(ProfileError, match="largest group"):
        ProfileRow("sd", "cpu", DENOISE, 128, 128, 5, 1, 5.0, 3, "t", groups=((64, 64, 2), (128, 128, 4)))
    with pytest.raises(ProfileError, match="full image denoise"):
        ProfileRow("sd", "cpu", DENOISE, 128, 128, 6, 1, 5.0, 3, "t", 1, 0.5, groups=((64, 64, 2), (128, 128, 4)))


@pytest.mark.parametrize("truth", [PackingFit(1.0, 0.0), PackingFit(0.0, 1.0), PackingFit(0.0, 1.25),
                                   PackingFit(0.6, 0.5)])
def test_the_fit_recovers_how_a_device_packs(truth):
    base = LinearCosts()
    profile = ProfiledCostModel(one_resolution_rows(base) + measured(truth, base))
    fit = packing_fits(profile, profile)["sd"]
    assert fit.roofline == pytest.approx(truth.roofline, abs=1e-6)
    assert fit.sequential == pytest.approx(truth.sequential, abs=1e-6)
    report = packing_report(profile, profile)["sd"]
    assert report.points == len(MIXES) and report.fit_held_out[1] < 1e-6
    costs = PackedForwardCosts(profile, fits={"sd": fit})
    mix = [BatchShape("sd", 64, 64, 6), BatchShape("sd", 128, 128, 4)]
    in_turn = sum(profile.denoise_seconds(b) for b in mix)
    assert costs.packed_forward_seconds(mix) == pytest.approx(truth.seconds(costs.estimate_seconds(mix), in_turn))
    assert "held-out" in report.format("sd")


def test_where_packing_costs_more_the_priced_round_costs_more_than_the_groups_in_turn():
    base = LinearCosts()
    profile = ProfiledCostModel(one_resolution_rows(base) + measured(PackingFit(0.0, 1.25), base))
    fitted = PackedForwardCosts(profile, fits=packing_fits(profile, profile))
    estimate = PackedForwardCosts(profile)
    mix = [BatchShape("sd", 64, 64, 4), BatchShape("sd", 128, 128, 4)]
    assert estimate.round_seconds(mix) < profile.round_seconds(mix) < fitted.round_seconds(mix)
    report = packing_report(profile, profile)["sd"]
    assert report.measured_over_sequential == pytest.approx((1.25, 1.25))
    assert report.sequential[0] == pytest.approx(0.2) and report.estimate[0] > report.sequential[0]


def test_a_packed_forward_never_costs_less_than_its_dearest_group_alone():
    base = LinearCosts()
    profile = ProfiledCostModel(one_resolution_rows(base))
    costs = PackedForwardCosts(profile, fits={"sd": PackingFit(0.1, 0.0)})
    mix = [BatchShape("sd", 64, 64, 2), BatchShape("sd", 128, 128, 8)]
    assert costs.packed_forward_seconds(mix) == pytest.approx(profile.denoise_seconds(mix[1]))


def test_one_packed_row_cannot_be_fitted_and_says_so():
    base = LinearCosts()
    profile = ProfiledCostModel(one_resolution_rows(base) + measured(PackingFit(1.0, 0.0), base)[:1])
    with pytest.raises(ProfileError, match="two or more packed rows"):
        packing_fits(profile, profile)
    assert packing_report(profile, profile) == {}
    assert len(packed_points(profile.packed_rows, profile)["sd"]) == 1
    with pytest.raises(ValueError, match="non-negative"):
        PackingFit(0.0, 0.0)
    with pytest.raises(ProfileError):
        fit_packing([])
