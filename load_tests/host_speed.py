"""A cost profile moved to another speed of the machine, and the median of profiles measured
across a benchmark's window.

On a shared VM the same computation's speed drifts by tens of percent within minutes, and the
speed of the workers under load does not follow the speed a profile measures at rest: between
two sim_vs_live benchmarks 40 minutes apart on the 2-core VM, the profile's in-process forward
got 13-15% slower while the live step under load got 5% faster. `scaled_profile` moves what a
profile measured in its own process (forwards, text encoding, decodes, the runner's bookkeeping)
to a measured speed; what it measured through the live app (the fixed round and request
overheads, the router's CPU) and the host's shares and ratios stay. `median_profile` spreads a
profile over the minutes of the runs it times.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from stepserve.policies.cost_model import (
    DENOISE, ROUND_OVERHEAD, TEXT_ENCODE, VAE_DECODE, ProfiledCostModel, ProfileRow, read_profile, resolve_profile,
    write_profile,
)


def in_process(row: ProfileRow) -> bool:
    """A time the profiler measured in its own process (a forward, text encoding, a decode, the
    runner's bookkeeping around a forward), not through the live app (the fixed round and the
    request overhead, the router's CPU) and not a share or ratio of the host."""
    return row.component in (DENOISE, TEXT_ENCODE, VAE_DECODE) or (row.component == ROUND_OVERHEAD and row.height > 0)


def scaled_profile(profiles: Sequence[str], factors: Mapping[str, float]) -> ProfiledCostModel:
    """The profiles (shipped names or CSV paths) with every time a model's profile measured in
    process multiplied by its factor (`factors`: model name -> factor; a model not named, and
    what the profiler measured through the live app, keep their times)."""
    for model, factor in factors.items():
        if not factor > 0:
            raise ValueError(f"a speed factor must be > 0, got {factor!r} for {model}")
    rows = [row for name in profiles for row in read_profile(resolve_profile(name))]
    return ProfiledCostModel([replace(row, latency_ms=row.latency_ms * factors[row.model])
                              if row.model in factors and in_process(row) else row for row in rows])


def median_profile(paths: Sequence[Path], out: Path) -> Path:
    """One profile from several of the same grid: each point's median time over the profiles
    that have it, its samples summed, written to `out`."""
    if not paths:
        raise ValueError("a median profile needs at least one profile")
    points: dict[tuple, list[ProfileRow]] = {}
    for path in paths:
        seen: dict[tuple, int] = {}  # a profile may hold one point twice (two cases with equal rows)
        for row in read_profile(path):
            key = (row.model, row.device, row.component, row.height, row.width, row.rows, row.frames, row.sp_degree)
            seen[key] = seen.get(key, 0) + 1
            points.setdefault((*key, seen[key]), []).append(row)
    rows = [replace(same[0], latency_ms=statistics.median(r.latency_ms for r in same),
                    samples=sum(r.samples for r in same),
                    source=f"median of {len(same)} profiles measured between live runs; the first: {same[0].source}")
            for same in points.values()]
    write_profile(out, rows)
    return out
