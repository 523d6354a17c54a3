"""Offline choice of the VAE chunking granularity c and of B_max (§III-C, Eq. 1-2).

A decode split into c chunks runs one chunk beside each of c consecutive UNet steps. The
profiler measures, for each c, round i's concurrent UNet step latency t_u^i and VAE chunk
latency t_v^i (`ChunkTiming`); from them:

    T_u(c) = sum_{i=1..c} max(t_u^i, t_v^i)                         Eq. 2, `unet_latency`
    T_v(c) = sum_{i=1..c-1} max(t_u^i, t_v^i) + t_v^c               Eq. 2, `vae_latency`
    L(c)   = lam (T_u(c) - T_u0) / T_u0 + (1 - lam) (T_v(c) - T_v0) / T_v0   Eq. 1, `chunk_cost`

T_v stops at the last chunk: the decoded image leaves for CPU post-processing without waiting
for the UNet step beside it. Reading of T_u0 and T_v0 (the paper names them "solo"): T_u0 is
c solo UNet steps, the same c rounds without a decode beside them, so the first term is the
UNet's slowdown from sharing the GPU; T_v0 is one whole decode run alone.

C_max (`max_chunks`): the paper defines it as "the maximum factor limiting latency overhead to
within 5% of solo UNet execution". Read here as: chunking finer is what brings the UNet's
overhead down, so C_max is the coarsest measured c at which the overhead (T_u(c) - T_u0)/T_u0
is already within 5%; no finer chunking is needed, and the search for c (and the controller's
chunk levels) stops there. If no measured c gets there, C_max is the finest measured.

B_max (`saturation_batch`): the smallest batch at which UNet throughput has reached its
plateau (§II-A's sub-linear scaling), i.e. is within 5% of the best measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stepserve.policies.synerdiff.checks import check_int, check_number


@dataclass(frozen=True)
class ChunkTiming:
    """One profiled granularity c: per round i = 1..c, t_u^i and t_v^i in seconds."""

    chunks: int
    unet: tuple[float, ...]
    vae: tuple[float, ...]

    def __post_init__(self) -> None:
        check_int("ChunkTiming", "chunks", self.chunks, 1)
        for name in ("unet", "vae"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or len(values) != self.chunks:
                raise ValueError(f"ChunkTiming(c={self.chunks}): {name} must be a tuple of {self.chunks} latencies, "
                                 f"got {values!r}")
            for value in values:
                check_number(f"ChunkTiming(c={self.chunks})", name, value, 0.0, low_open=True)


def unet_latency(timing: ChunkTiming) -> float:
    """T_u(c): a UNet step waits for the chunk beside it in every round."""
    return sum(max(tu, tv) for tu, tv in zip(timing.unet, timing.vae))


def vae_latency(timing: ChunkTiming) -> float:
    """T_v(c): the decode's last round ends with its own chunk."""
    return sum(max(tu, tv) for tu, tv in zip(timing.unet[:-1], timing.vae[:-1])) + timing.vae[-1]


def unet_overhead(timing: ChunkTiming, unet_solo: float) -> float:
    """(T_u(c) - T_u0) / T_u0 with T_u0 = c solo UNet steps."""
    check_number("unet_overhead", "unet_solo", unet_solo, 0.0, low_open=True)
    solo = timing.chunks * unet_solo
    return (unet_latency(timing) - solo) / solo


def chunk_cost(timing: ChunkTiming, unet_solo: float, vae_solo: float, lam: float) -> float:
    """L(c) of Eq. 1."""
    check_number("chunk_cost", "vae_solo", vae_solo, 0.0, low_open=True)
    check_number("chunk_cost", "lam", lam, 0.0, 1.0)
    vae_overhead = (vae_latency(timing) - vae_solo) / vae_solo
    return lam * unet_overhead(timing, unet_solo) + (1.0 - lam) * vae_overhead


def _by_chunks(timings: Iterable[ChunkTiming]) -> list[ChunkTiming]:
    ordered = sorted(timings, key=lambda t: t.chunks)
    if not ordered:
        raise ValueError("chunking: no ChunkTiming measured")
    counts = [t.chunks for t in ordered]
    if len(set(counts)) != len(counts):
        raise ValueError(f"chunking: a granularity is measured twice: {counts}")
    return ordered


def max_chunks(timings: Iterable[ChunkTiming], unet_solo: float, overhead: float = 0.05) -> int:
    """C_max: the smallest measured c whose UNet overhead is within `overhead`, else the largest c."""
    check_number("max_chunks", "overhead", overhead, 0.0)
    ordered = _by_chunks(timings)
    for timing in ordered:
        if unet_overhead(timing, unet_solo) <= overhead:
            return timing.chunks
    return ordered[-1].chunks


def choose_chunks(timings: Iterable[ChunkTiming], unet_solo: float, vae_solo: float, lam: float = 0.5,
                  overhead: float = 0.05) -> int:
    """The offline c: argmin L(c) over the measured c <= C_max (ties: the smaller c)."""
    ordered = _by_chunks(timings)
    ceiling = max_chunks(ordered, unet_solo, overhead)
    candidates = [t for t in ordered if t.chunks <= ceiling]
    # min() keeps the first of equal costs, and candidates run from the smallest c up.
    return min(candidates, key=lambda t: chunk_cost(t, unet_solo, vae_solo, lam)).chunks


def saturation_batch(step_seconds: Mapping[int, float], within: float = 0.05) -> int:
    """B_max: the smallest measured batch whose throughput (batch / step seconds) is within
    `within` (a fraction) of the best measured throughput."""
    check_number("saturation_batch", "within", within, 0.0, 1.0)
    if not isinstance(step_seconds, Mapping) or not step_seconds:
        raise ValueError(f"saturation_batch: step_seconds must be a non-empty {{batch: seconds}} mapping, "
                         f"got {step_seconds!r}")
    for batch, seconds in step_seconds.items():
        check_int("saturation_batch", "batch", batch, 1)
        check_number(f"saturation_batch (batch {batch})", "seconds", seconds, 0.0, low_open=True)
    throughput = {batch: batch / seconds for batch, seconds in step_seconds.items()}
    best = max(throughput.values())
    return min(batch for batch, value in throughput.items() if value >= (1.0 - within) * best)
