"""Skip-CFG eligibility from the measured fidelity curve (§III-B Fig. 9, §III-D s_min)."""

from __future__ import annotations

import pytest

from stepserve.policies.synerdiff import SkipCfgCurve

# Fig. 9's shape: skipping CFG from early on hurts, from late on hardly at all. f = 1.0 skips
# nothing, so it is exact.
CURVE = SkipCfgCurve(((0.2, 0.80), (0.4, 0.93), (0.6, 0.97), (0.8, 0.99), (1.0, 1.0)))


@pytest.mark.parametrize("quality, steps, first", [
    (0.95, 50, 30),
    (0.98, 50, 40),
    (0.93, 50, 20),
    (0.5, 50, 10),
    (0.5, 20, 4),
    (0.95, 7, 5),  # ceil(0.6 * 7) = ceil(4.2)
    (1.0, 50, None),  # the best level: never skip
    (0.995, 50, None),  # only f = 1.0 qualifies, which leaves no step to skip
])
def test_first_step(quality, steps, first):
    assert CURVE.first_step(quality, steps) == first


def test_a_later_bad_point_disqualifies_earlier_good_ones():
    curve = SkipCfgCurve(((0.5, 0.99), (0.7, 0.90), (0.9, 0.98)))
    assert curve.first_fraction(0.95) == 0.9
    assert curve.first_step(0.95, 20) == 18
    assert curve.first_step(0.99, 20) is None  # the last point misses it: nothing qualifies
    assert curve.first_fraction(0.85) == 0.5


def test_integer_products_are_not_rounded_up():
    for tenths in range(1, 10):
        curve = SkipCfgCurve(((tenths / 10, 0.99),))
        for steps in (10, 20, 30, 50):
            assert curve.first_step(0.95, steps) == tenths * steps // 10


def test_eligible():
    assert not CURVE.eligible(29, 50, 0.95)
    assert CURVE.eligible(30, 50, 0.95)
    assert CURVE.eligible(49, 50, 0.95)
    assert not CURVE.eligible(49, 50, 1.0)
    assert CURVE.eligible(0, 50, 0.0) is False  # f starts at 0.2 here
    assert SkipCfgCurve(((0.0, 0.5),)).eligible(0, 50, 0.4)


@pytest.mark.parametrize("points", [
    (),
    [(0.5, 0.9)],
    ((0.5, 0.9), (0.5, 0.95)),
    ((0.6, 0.9), (0.5, 0.95)),
    ((1.2, 0.9),),
    ((-0.1, 0.9),),
    ((0.5, 1.1),),
    ((0.5,),),
    ((0.5, float("nan")),),
])
def test_curve_validation(points):
    with pytest.raises(ValueError, match="SkipCfgCurve"):
        SkipCfgCurve(points)


def test_query_validation():
    with pytest.raises(ValueError, match="steps"):
        CURVE.first_step(0.95, 0)
    with pytest.raises(ValueError, match="quality"):
        CURVE.first_step(-0.1, 10)
    with pytest.raises(ValueError, match="step_index"):
        CURVE.eligible(10, 10, 0.95)
    with pytest.raises(ValueError, match="step_index"):
        CURVE.eligible(-1, 10, 0.95)
