"""A profile's per-slot block costs, as the loading DP reads them: read back from the CSV, looked up
by shape, interpolated in mask ratio and rows between measured points, none beyond them."""

import pytest

from stepserve.policies.cost_model import (
    BLOCK_CACHED,
    BLOCK_FULL,
    BLOCK_LOAD,
    DENOISE,
    ProfiledCostModel,
    ProfileError,
    ProfileRow,
    read_profile,
    write_profile,
)
from stepserve.policies.instgenie.block_profile import MeasuredBlockCosts

M = "m"


def block(component, slot, ms, rows=2, ratio=1.0, size=64):
    return ProfileRow(M, "cpu", component, size, size, rows, 1, ms, 3, "measured", mask_ratio=ratio, slot=slot)


def shape_rows(rows=2, scale=1.0):
    """Two slots: C_w 1/2 ms at 0.25 and 2/3 ms at 0.5, C_wo 4/5 ms, L 0.5/0.5 ms (times `scale`)."""
    out = [block(BLOCK_CACHED, s, (1 + s + k) * scale, rows, ratio) for k, ratio in enumerate((0.25, 0.5))
           for s in range(2)]
    out += [block(BLOCK_FULL, s, (4 + s) * scale, rows) for s in range(2)]
    return out + [block(BLOCK_LOAD, s, 0.5 * scale, rows) for s in range(2)]


def test_block_rows_round_trip_through_the_csv_and_stay_out_of_the_fits(tmp_path):
    rows = shape_rows() + [ProfileRow(M, "cpu", DENOISE, 64, 64, 2, 1, 9.0, 3, "measured")]
    path = tmp_path / "p.csv"
    write_profile(path, rows)
    back = read_profile(path)
    assert sorted(back, key=repr) == sorted(rows, key=repr)
    model = ProfiledCostModel(back)
    assert len(model.block_rows) == 6 + 2 and not model.masked_rows and "block_cached" not in model.fit_report()[M]
    with pytest.raises(ProfileError, match="slot"):
        ProfileRow(M, "cpu", BLOCK_FULL, 64, 64, 2, 1, 1.0, 3, "x")  # a block row without its slot
    with pytest.raises(ProfileError, match="slot"):
        ProfileRow(M, "cpu", DENOISE, 64, 64, 2, 1, 1.0, 3, "x", slot=0)
    with pytest.raises(ProfileError, match="mask_ratio"):
        block(BLOCK_FULL, 0, 1.0, ratio=0.5)


def test_costs_at_a_measured_point_and_between_points():
    costs = MeasuredBlockCosts.from_rows(shape_rows(2) + shape_rows(6, scale=3.0))
    ms = lambda triple: tuple(tuple(round(v * 1e3, 9) for v in part) for part in triple)  # noqa: E731
    assert ms(costs.at(M, 64, 64, 2, 0.25)) == ((1, 2), (4, 5), (0.5, 0.5))
    assert ms(costs.at(M, 64, 64, 2, 0.375)) == ((1.5, 2.5), (4, 5), (0.5, 0.5))
    # Above the largest measured share, C_w runs to C_wo at 1; below the smallest, the smallest's.
    assert ms(costs.at(M, 64, 64, 2, 0.75)) == ((3, 4), (4, 5), (0.5, 0.5))
    assert ms(costs.at(M, 64, 64, 2, 0.1)) == ((1, 2), (4, 5), (0.5, 0.5))
    # Rows between two measured rows: linear in each cost.
    assert ms(costs.at(M, 64, 64, 4, 0.25)) == ((2, 4), (8, 10), (1, 1))


def test_no_costs_beyond_the_measured_rows_or_for_another_size_or_model():
    costs = MeasuredBlockCosts.from_rows(shape_rows(2) + shape_rows(6))
    assert costs.at(M, 64, 64, 8, 0.25) is None and costs.at(M, 64, 64, 1, 0.25) is None
    assert costs.at(M, 128, 128, 2, 0.25) is None and costs.at("other", 64, 64, 2, 0.25) is None


def test_a_shape_missing_a_slot_or_measured_twice_is_refused():
    rows = shape_rows()
    with pytest.raises(ProfileError, match="block_load"):
        MeasuredBlockCosts.from_rows(rows[:-1])
    with pytest.raises(ProfileError, match="twice"):
        MeasuredBlockCosts.from_rows(rows + rows[:1])
