"""Argument checks the SynerDiff values and functions share.

Each raises ValueError with a message that names the owner and the field, so a malformed
profile row or config fails where it is built rather than deep inside a planner.
"""

from __future__ import annotations

import math


def check_int(owner: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; `True` as a count is a typo, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def check_number(owner: str, name: str, value: object, low: float, high: float = math.inf,
                 low_open: bool = False) -> None:
    """A finite real in [low, high] ((low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{owner}: {name} must be in {bracket}{low}, {high}], got {value!r}")
