"""Adaptive skip-CFG eligibility from a quality threshold S (§III-B, Fig. 9; §III-D's s_min).

The profiler measures, for a few fractions f, the fidelity (DINO similarity to the exact image,
in [0, 1]) of a request that runs CFG for its first f of the steps and skips it from there to
the end (Fig. 9's method). Early steps are CFG-sensitive and late ones are not, so skipping
from later on is expected to be at least as faithful; the curve is not required to be
monotone, though: a fraction qualifies for threshold S only if it and every later measured
fraction reach S, so one good point cannot hide a bad one after it.

    s_min = ceil(f_min * steps)         (0-based step index; steps s >= s_min may skip)

A UNet task is eligible for skip-CFG in a round when its next step index is >= s_min
(§III-D: "u_i is eligible for Skip-CFG only if s_i >= s_min"); K of plan_sequence counts them.
S = 1.0 (the controller's best level) means never skip.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.policies.synerdiff.checks import check_int, check_number
from stepserve.policies.types import first_skipping_step

@dataclass(frozen=True)
class SkipCfgCurve:
    """Measured (f, similarity) points, f strictly increasing in [0, 1], similarity in [0, 1]."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.points, tuple) or not self.points:
            raise ValueError(f"SkipCfgCurve: points must be a non-empty tuple of (f, similarity), got {self.points!r}")
        for point in self.points:
            if not isinstance(point, tuple) or len(point) != 2:
                raise ValueError(f"SkipCfgCurve: a point is (f, similarity), got {point!r}")
            check_number("SkipCfgCurve", "f", point[0], 0.0, 1.0)
            check_number("SkipCfgCurve", "similarity", point[1], 0.0, 1.0)
        fractions = [f for f, _ in self.points]
        if any(a >= b for a, b in zip(fractions, fractions[1:])):
            raise ValueError(f"SkipCfgCurve: fractions must be strictly increasing, got {fractions}")

    def first_fraction(self, quality: float) -> float | None:
        """f_min: the smallest measured f whose point and every later point reach `quality`."""
        check_number("SkipCfgCurve", "quality", quality, 0.0)
        if quality >= 1.0:
            return None
        found = None
        for f, similarity in reversed(self.points):
            if similarity < quality:
                break
            found = f
        return found

    def first_step(self, quality: float, steps: int) -> int | None:
        """s_min for a request of `steps` steps; None: it never skips (also when f_min * steps
        rounds up to `steps`, leaving no step to skip)."""
        check_int("SkipCfgCurve", "steps", steps, 1)
        fraction = self.first_fraction(quality)
        return None if fraction is None else first_skipping_step(fraction, steps)

    def eligible(self, step_index: int, steps: int, quality: float) -> bool:
        """Whether step `step_index` (0-based) of a `steps`-step request may run without CFG."""
        check_int("SkipCfgCurve", "step_index", step_index, 0)
        check_int("SkipCfgCurve", "steps", steps, 1)
        if step_index >= steps:
            raise ValueError(f"SkipCfgCurve: step_index {step_index} is past the last step of {steps}")
        first = self.first_step(quality, steps)
        return first is not None and step_index >= first
