"""Packed pricing checked and calibrated against a profile's packed forwards (PatchedServe §4 on
this device's numbers).

`stepserve profile` times, for a model whose family runs several resolutions in one forward,
that forward for mixes of its grid's sizes: denoise rows with `groups`. For each, the profile's
one-resolution rows give two prices: the roofline estimate (`PackedForwardCosts.estimate_seconds`)
and the groups one after another (what a worker that does not pack runs). A model's packed
forwards are fitted as `a x estimate + b x sequential` (a, b >= 0; least squares of the relative
error, as the profile's own fits), which spans a device that packs as the roofline says (1, 0),
one that gains nothing (0, 1) and one where packing costs more than it saves (0, b > 1).

What the router asks: `packing_fits(profile, costs)`, the fit of every model with packed rows.
`packing_report` says how far each price is from the measured forwards: the estimate's and the
sequential price's error at the points, and the fit's held out (leave one out).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stepserve.policies.cost_model import BatchShape, CostModel, ProfiledCostModel, ProfileError, ProfileRow
from stepserve.policies.patchedserve.mixed_costs import PackedForwardCosts, PackingFit


@dataclass(frozen=True)
class PackedPoint:
    """One measured packed forward beside its two prices from one-resolution rows."""

    batches: tuple[BatchShape, ...]
    measured_s: float
    estimate_s: float
    sequential_s: float


def packed_points(rows: Iterable[ProfileRow], costs: CostModel) -> dict[str, list[PackedPoint]]:
    """Per model, its packed rows among `rows` priced by `costs` (the profile's one-resolution rows)."""
    pricing = PackedForwardCosts(costs)
    points: dict[str, list[PackedPoint]] = {}
    for row in rows:
        if row.groups:
            batches = tuple(BatchShape(row.model, height, width, n) for height, width, n in row.groups)
            in_turn = sum(costs.denoise_seconds(b) for b in batches)
            points.setdefault(row.model, []).append(
                PackedPoint(batches, row.seconds, pricing.estimate_seconds(batches), in_turn))
    return points


def fit_packing(points: list[PackedPoint]) -> PackingFit:
    """The non-negative (a, b) minimising the squared relative error of a x estimate + b x
    sequential over `points`: the unconstrained optimum where it is non-negative, else the better
    of a alone and b alone."""
    if len(points) < 2:
        raise ProfileError(f"fitting packed forwards takes two or more packed rows, got {len(points)}")
    est = [p.estimate_s / p.measured_s for p in points]
    seq = [p.sequential_s / p.measured_s for p in points]
    ee, ss, es = sum(e * e for e in est), sum(s * s for s in seq), sum(e * s for e, s in zip(est, seq))
    e1, s1 = sum(est), sum(seq)
    candidates = [PackingFit(e1 / ee, 0.0), PackingFit(0.0, s1 / ss)]
    det = ee * ss - es * es
    if det > 1e-12 * ee * ss:
        a, b = (e1 * ss - s1 * es) / det, (s1 * ee - e1 * es) / det
        if a >= 0 and b >= 0:
            candidates.append(PackingFit(a, b))

    def loss(fit: PackingFit) -> float:
        return sum((fit.roofline * e + fit.sequential * s - 1) ** 2 for e, s in zip(est, seq))

    return min(candidates, key=loss)


def packing_fits(profile: ProfiledCostModel, costs: CostModel) -> dict[str, PackingFit]:
    """The fit of each model with packed rows in `profile`, priced by `costs` (the profile, or a
    cost model wrapping it). Raises `ProfileError` where a model has a single packed row."""
    return {model: fit_packing(points) for model, points in packed_points(profile.packed_rows, costs).items()}


@dataclass(frozen=True)
class PackingReport:
    """How each price meets one model's measured packed forwards: mean and max relative error."""

    points: int
    fit: PackingFit
    fit_held_out: tuple[float, float] | None  # leave one out; None with fewer than 3 points
    estimate: tuple[float, float]
    sequential: tuple[float, float]
    measured_over_sequential: tuple[float, float]  # min and max: below 1, packing paid off

    def format(self, model: str) -> str:
        held = ("n/a (< 3 points)" if self.fit_held_out is None
                else f"mean {self.fit_held_out[0]:.1%}, max {self.fit_held_out[1]:.1%}")
        lo, hi = self.measured_over_sequential
        return (f"  {model} denoise (packed) {self.points} pts: measured / groups in turn {lo:.2f}-{hi:.2f}x; "
                f"fit {self.fit.roofline:.2f} x estimate + {self.fit.sequential:.2f} x in turn, held-out {held}; "
                f"the estimate alone: mean {self.estimate[0]:.1%}, max {self.estimate[1]:.1%}; "
                f"in turn: mean {self.sequential[0]:.1%}, max {self.sequential[1]:.1%}")


def packing_report(profile: ProfiledCostModel, costs: CostModel) -> dict[str, PackingReport]:
    """Per model with two or more packed rows: its `PackingReport`."""
    reports = {}
    for model, points in packed_points(profile.packed_rows, costs).items():
        if len(points) < 2:
            continue
        held_out = None
        if len(points) >= 3:  # priced as the router would, the floor of the dearest group included
            held_out = _errors([(PackedForwardCosts(costs, fits={model: fit_packing(points[:i] + points[i + 1:])})
                                 .packed_forward_seconds(p.batches), p.measured_s) for i, p in enumerate(points)])
        fit = fit_packing(points)
        reports[model] = PackingReport(
            len(points), fit, held_out, _errors([(p.estimate_s, p.measured_s) for p in points]),
            _errors([(p.sequential_s, p.measured_s) for p in points]),
            (min(p.measured_s / p.sequential_s for p in points), max(p.measured_s / p.sequential_s for p in points)))
    return reports


def _errors(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(mean, max) relative error of (predicted, measured) pairs."""
    errors = [abs(predicted - measured) / measured for predicted, measured in pairs]
    return sum(errors) / len(errors), max(errors)
