"""Per-slot costs of masked forwards as a profile measured them, for the loading DP (InstGenIE §4.2,
Algorithm 1's C_w, C_wo and L of every block).

`stepserve profile` writes, per model, size and rows, each cache slot's `block_full` (C_wo: every
token computed) and `block_load` (L: its cached activations brought to the device) rows, and its
`block_cached` rows (C_w: the masked tokens computed, the rest from the cache) at a few mask
ratios. `MeasuredBlockCosts.at` answers a forward's shape from them:

- mask ratio (the share of tokens computed): C_w piecewise-linear between the measured shares,
  from the largest to C_wo at 1 (every token computed); below the smallest, the smallest's (a
  smaller mask never costs more, so this errs towards computing in full, which is exact);
- rows: each cost linear between the two measured rows around the forward's; none beyond them;
- size: the measured sizes only.

Where it has no answer (`None`) the worker loads every block and counts the forward as planned
without costs: no cost is ever made up.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stepserve.policies.cost_model import BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD, ProfileError, ProfileRow

# Per slot, in slot order: (C_w, C_wo, L), `pipeline_dp.plan`'s three cost arguments.
SlotCosts = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]


@dataclass(frozen=True)
class RowsCosts:
    """One model, size and rows: C_w at each measured share (rising), C_wo and L, per slot."""

    shares: tuple[float, ...]
    c_with: tuple[tuple[float, ...], ...]
    c_without: tuple[float, ...]
    load: tuple[float, ...]

    def at(self, share: float) -> SlotCosts:
        shares, c_with = (*self.shares, 1.0), (*self.c_with, self.c_without)
        k = bisect.bisect_left(shares, share)
        if k == 0:
            return c_with[0], self.c_without, self.load
        k = min(k, len(shares) - 1)
        w = (share - shares[k - 1]) / (shares[k] - shares[k - 1])
        return _mix(c_with[k - 1], c_with[k], w), self.c_without, self.load


@dataclass(frozen=True)
class MeasuredBlockCosts:
    """Block costs by (model, height, width), then by rows."""

    shapes: Mapping[tuple[str, int, int], Mapping[int, RowsCosts]]

    @classmethod
    def from_rows(cls, rows: Iterable[ProfileRow]) -> MeasuredBlockCosts:
        """From a profile's block rows (other rows are ignored). Raises `ProfileError` where a
        shape's slots are not all measured, or measured twice."""
        found: dict[tuple[str, int, int, int], dict[tuple[str, float], dict[int, float]]] = {}
        for row in rows:
            if row.slot is None:
                continue
            costs = found.setdefault((row.model, row.height, row.width, row.rows), {})
            slots = costs.setdefault((row.component, row.mask_ratio if row.component == BLOCK_CACHED else 1.0), {})
            if row.slot in slots:
                raise ProfileError(f"{row.model} {row.height}x{row.width} rows {row.rows}: {row.component} of slot "
                                   f"{row.slot} at mask ratio {row.mask_ratio} measured twice")
            slots[row.slot] = row.seconds
        shapes: dict[tuple[str, int, int], dict[int, RowsCosts]] = {}
        for (model, height, width, n_rows), costs in sorted(found.items()):
            where = f"{model} {height}x{width} rows {n_rows}"
            n = max(len(s) for s in costs.values())

            def slots(key: tuple[str, float]) -> tuple[float, ...]:
                measured = costs.get(key, {})
                if sorted(measured) != list(range(n)):
                    raise ProfileError(f"{where}: {key[0]} at {key[1]} has slots {sorted(measured)}, not 0..{n - 1}")
                return tuple(measured[s] for s in range(n))

            shares = tuple(sorted(share for component, share in costs if component == BLOCK_CACHED))
            if not shares or any(share >= 1.0 for share in shares):
                raise ProfileError(f"{where}: block_cached rows need mask ratios below 1, got {list(shares)}")
            shapes.setdefault((model, height, width), {})[n_rows] = RowsCosts(
                shares, tuple(slots((BLOCK_CACHED, s)) for s in shares), slots((BLOCK_FULL, 1.0)),
                slots((BLOCK_LOAD, 1.0)))
        return cls(shapes)

    def at(self, model: str, height: int, width: int, rows: int, share: float) -> SlotCosts | None:
        """The per-slot costs of a forward of `rows` rows computing `share` of its image tokens,
        or None where the profile has none for that size or those rows."""
        by_rows = self.shapes.get((model, height, width))
        if not by_rows:
            return None
        measured = sorted(by_rows)
        k = bisect.bisect_left(measured, rows)
        if k < len(measured) and measured[k] == rows:
            return by_rows[rows].at(share)
        if k == 0 or k == len(measured):
            return None
        low, high = measured[k - 1], measured[k]
        w = (rows - low) / (high - low)
        return tuple(_mix(a, b, w) for a, b in zip(by_rows[low].at(share), by_rows[high].at(share)))  # type: ignore


def _mix(a: tuple[float, ...], b: tuple[float, ...], w: float) -> tuple[float, ...]:
    return tuple(x + (y - x) * w for x, y in zip(a, b))
