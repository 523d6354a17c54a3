"""How fast this machine computes right now, a cost profile moved to that speed, and the
median of profiles measured across a benchmark's window.

On a shared VM the same computation's speed drifts by tens of percent within minutes: on the
2-core VM one 64 px forward took 8.4 ms in one profile and 13.3 ms in the next, a quarter of an
hour later. A profile measured at one moment then times a live run made at another on what is
in effect a different machine, and a simulator-vs-live comparison measures the drift rather
than the simulator. The speed index is the median time of one fixed forward in this process
(one thread, like the workers); taken around the profile and around each live run, the ratio
of the two moves the profile to the live run's speed: every time in it scales by that ratio
(the host's idle share of cores and the ratios of its host probe do not change). A profile
measured again between live runs, and their median (`median_profile`), spreads the profile over
the same minutes as the runs instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from stepserve.engine.families import DENOISER, TEXT, ModelSource, load_family
from stepserve.policies.cost_model import (
    HOST_IDLE, ProfiledCostModel, ProfileRow, read_profile, resolve_profile, write_profile,
)
from stepserve.profile import probe_forward

WARMUP = 10
REPEATS = 150  # about 1.5-2 s of a 64 px forward on the 2-core VM


class SpeedProbe:
    """The speed index: one image model's forward at one size, timed in this process."""

    def __init__(self, source: ModelSource, size: int, rows: int, threads: int = 1, repeats: int = REPEATS):
        self.threads, self.repeats = threads, repeats
        self._forward = probe_forward(load_family(source, {TEXT, DENOISER}, "cpu"), size, rows)

    def seconds(self) -> float:
        """The median time of one forward, now."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            for _ in range(WARMUP):
                self._forward()
            times = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                self._forward()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        finally:
            torch.set_num_threads(threads)


def scaled_profile(profiles: Sequence[str], factor: float) -> ProfiledCostModel:
    """The profiles (shipped names or CSV paths) with every time multiplied by `factor`."""
    if not factor > 0:
        raise ValueError(f"a speed factor must be > 0, got {factor!r}")
    rows = [row for name in profiles for row in read_profile(resolve_profile(name))]
    return ProfiledCostModel([row if row.component == HOST_IDLE else replace(row, latency_ms=row.latency_ms * factor)
                              for row in rows])


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
