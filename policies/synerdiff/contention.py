"""How a denoising step and VAE decodes slow each other on one GPU, and the concurrent-latency
table T_cost^c(m, n, k) built from it (§II-A, §III-C) where no profiler has measured one.

DERIVED, not measured: the paper publishes its table only as Table I (six SD1.5 tasks on an RTX
5090) and Fig. 8 (chunking and skip-CFG against concurrent latency), and no machine here can
measure a GPU's contention. The model: a round runs the UNet step of its m tasks (k of them
without their unconditional row), t_u, beside its n VAE tasks, each one chunk (1/c) of a decode,
one after another (decoding is batch-insensitive, Fig. 3), t_v; the two overlap, and the shorter
adds a share gamma(c) of itself to the round:

    tau   = max(t_u, t_v) + gamma(c) * min(t_u, t_v)
    delta = t_v + gamma(c) * min(t_u, t_v)            (the round's decodes end with their slowdown)
    gamma(c) = floor + (whole - floor) / c

`whole` (0.8) is the spike of an unchunked decode: with a decode as long as the step, the round
takes 1.8x the step, InstGenIE's 45% UNet throughput drop under concurrency (§IV-B3, Fig. 13).
`floor` (0.05) is what fine chunks leave: the "near-lossless parallelism" of Fig. 8, within the
5% overhead that defines C_max (§III-C). Finer chunks weaken the bandwidth contention (the 1/c
term) at the price of a decode spread over c rounds: the trade-off L(c) weighs (chunking.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stepserve.policies.synerdiff.checks import check_int, check_number
from stepserve.policies.synerdiff.types import ConcurrencyTable, Round


@dataclass(frozen=True)
class Contention:
    whole: float = 0.8  # gamma(1): an unchunked decode beside a step
    floor: float = 0.05  # gamma's limit as chunks get finer

    def __post_init__(self) -> None:
        check_number("Contention", "floor", self.floor, 0.0, 1.0)
        check_number("Contention", "whole", self.whole, self.floor, 1.0)

    def gamma(self, chunks: int) -> float:
        check_int("Contention.gamma", "chunks", chunks, 1)
        return self.floor + (self.whole - self.floor) / chunks

    def round(self, unet_s: float, vae_s: float, chunks: int) -> tuple[float, float]:
        """(tau, delta) of a round whose step alone takes `unet_s` and whose decode chunks alone
        take `vae_s` (0 for either: that part is absent)."""
        shared = self.gamma(chunks) * min(unet_s, vae_s)
        return max(unet_s, vae_s) + shared, (vae_s + shared if vae_s > 0 else 0.0)


def concurrency_table(unet_seconds: Callable[[int, int], float], decode_seconds: float, chunks: int,
                      max_batch: int, max_vae: int, contention: Contention = Contention()) -> ConcurrencyTable:
    """T_cost^c(m, n, k) for m <= max_batch, n <= max_vae (n <= m, or m = 0), k <= m:
    `unet_seconds(m, k)` is the step of m tasks with k skipping CFG alone (m >= 1),
    `decode_seconds` one whole decode alone."""
    check_int("concurrency_table", "max_batch", max_batch, 1)
    check_int("concurrency_table", "max_vae", max_vae, 0)
    chunk = decode_seconds / chunks
    entries: dict[Round, tuple[float, float]] = {}
    for m in range(max_batch + 1):
        for n in range(max_vae + 1 if m == 0 else min(m, max_vae) + 1):
            for k in range(m + 1):
                if m or n:
                    unet = unet_seconds(m, k) if m else 0.0
                    entries[Round(m, n, k)] = contention.round(unet, n * chunk, chunks)
    return ConcurrencyTable(entries, chunks=chunks, max_batch=max_batch)
