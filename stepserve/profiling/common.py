"""What every part of `stepserve profile` shares: the grids, the stopwatch and interleaved timing,
threads, the measurement context (one row writer) and a forward's inputs."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stepserve.policies.cost_model import (
    ProfileRow,
)


@dataclass(frozen=True)
class ProfileGrid:
    sizes: tuple[int, ...]  # square sides, px
    batches: tuple[int, ...]  # requests per forward
    texts: tuple[int, ...]  # strings per text-encoder call
    overhead_batches: tuple[int, ...]  # batches whose round bookkeeping is measured
    warmup: int = 1
    repeats: int = 7
    rpc_repeats: int = 200
    live_steps: tuple[int, int] = (1, 11)
    live_repeats: int = 5
    # Masked forwards (profiling/edits.py): edits per forward (CFG's 2 rows each where the model
    # guides by CFG), at every size, and the mask ratios they compute (none: not measured).
    masked_batches: tuple[int, ...] = (1, 4, 8)
    mask_ratios: tuple[float, ...] = (0.1, 0.2, 0.5)
    # Packed forwards (profiling/packed.py): requests of each size in every mix of the grid's sizes.
    packed_batches: tuple[int, ...] = (1, 2, 4)

    def __post_init__(self) -> None:
        if not all(0.0 < m < 1.0 for m in self.mask_ratios):
            raise ValueError(f"mask ratios must be in (0, 1), got {list(self.mask_ratios)}")

    @property
    def rows(self) -> tuple[int, ...]:
        """Batch rows of every forward the grid asks for: b without CFG, 2b with it."""
        return tuple(sorted({b for b in self.batches} | {2 * b for b in self.batches}))


GRIDS = {
    # 15 pairs of live solo requests (about 5 s on the CPU VM): their medians set the round and
    # request overheads, and 5 let one slow second of the VM move them by tens of percent.
    "cpu": ProfileGrid(sizes=(64, 128, 256), batches=tuple(range(1, 9)), texts=(1, 2, 4, 8, 16),
                       overhead_batches=(1, 4, 8), live_repeats=15),
    "cuda": ProfileGrid(sizes=(512, 768, 1024), batches=tuple(range(1, 17)), texts=(1, 2, 4, 8, 16, 32),
                        overhead_batches=(1, 8, 16), warmup=2, repeats=10, live_repeats=15),
}
QUICK = ProfileGrid(sizes=(64,), batches=(1, 2), texts=(1, 2), overhead_batches=(1, 2), warmup=1, repeats=3,
                    rpc_repeats=50, live_repeats=3, masked_batches=(1, 2))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({os.cpu_count()} cores), torch {torch.__version__}"


class Stopwatch:
    """Wall time of a call; on CUDA it synchronizes first and after, so queued kernels count."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def interleaved_times(cases: dict[Any, Callable[[], Any]], watch: Stopwatch, warmup: int,
                      repeats: int) -> dict[Any, list[float]]:
    """Warm every case, then time them round-robin `repeats` times: drift on a shared machine
    then hits every case alike instead of whichever happened to run during it."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[Any, list[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key, fn in cases.items():
            times[key].append(watch.time(fn))
    return times


def interleaved_medians(cases: dict[Any, Callable[[], Any]], watch: Stopwatch, warmup: int, repeats: int,
                        label: Callable[[Any], str]) -> dict[Any, float]:
    """`interleaved_times`' median per case, logged."""
    medians = {key: statistics.median(ts) for key, ts in interleaved_times(cases, watch, warmup, repeats).items()}
    for key, value in medians.items():
        log(f"  {label(key)}: {value * 1e3:.3f} ms")
    return medians


DEFAULT_THREADS = torch.get_num_threads()


def set_threads(threads: int | None) -> int:
    """A component's configured thread count, or torch's default when it sets none."""
    torch.set_num_threads(threads or DEFAULT_THREADS)
    return torch.get_num_threads()


@dataclass
class Context:
    model: str
    device: str
    family: Any
    grid: ProfileGrid
    watch: Stopwatch
    source: str  # "measured <date>"

    def row(self, component: str, latency_s: float, samples: int, height: int = 0, width: int = 0, rows: int = 1,
            note: str = "", frames: int = 1, sp_degree: int = 1, mask_ratio: float = 1.0,
            groups: tuple[tuple[int, int, int], ...] = (), slot: int | None = None) -> ProfileRow:
        return ProfileRow(self.model, self.device, component, height, width, rows, frames, latency_s * 1e3, samples,
                          f"{self.source}; {note}" if note else self.source, sp_degree, mask_ratio, groups, slot)


def choose_grid(args: argparse.Namespace, device: str) -> ProfileGrid:
    grid = QUICK if args.quick else GRIDS["cuda" if device.startswith("cuda") else "cpu"]
    changes = {}
    if args.sizes:
        changes["sizes"] = tuple(args.sizes)
    if args.batches:
        changes["batches"] = tuple(args.batches)
    if args.repeats:
        changes["repeats"] = args.repeats
    if args.mask_ratios is not None:
        changes["mask_ratios"] = tuple(args.mask_ratios)
    return grid if not changes else ProfileGrid(**{**grid.__dict__, **changes})


PROMPT = "a photograph of a red fox in the snow"  # what the component timings condition on


def first_timestep(family, size: int = 64) -> torch.Tensor:
    """The first of 20 timesteps, set as a request's are (flow-matching families shift them by size)."""
    from stepserve.policies.types import RequestSpec

    spec = RequestSpec("t", family.source.name, PROMPT, size, size, 20, 1.0, 0, kind=family.kind)
    scheduler = family.make_scheduler()
    family.prepare_scheduler(scheduler, spec)
    return scheduler.timesteps[0]


def forward_inputs(family, text, t: torch.Tensor, rows: int, size: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A forward's random latents, timesteps and text conditioning for `rows` rows at `size` px."""
    from stepserve.engine.text_encoding import conditioning_rows

    side = size // family.vae_scale_factor
    sample = torch.randn(rows, family.latent_channels, side, side, generator=generator)
    sample = sample.to(device=family.device, dtype=family.dtype)
    return sample, t.reshape(1).expand(rows), conditioning_rows(family, text, rows, size, size)
