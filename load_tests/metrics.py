"""The one summary of a load run: counts, throughput and latency percentiles. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .records import RequestRecord


@dataclass(frozen=True)
class Summary:
    count: int
    ok: int
    failed: int  # any non-200 answer or no answer at all
    span_s: float  # first scheduled send to last successful completion
    throughput_rps: float  # successful completions per second of span
    # Latency statistics cover successful requests only; None when there are none.
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    max_send_lag_s: float | None  # worst (sent - scheduled): how far the generator fell behind


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default), so small samples give stable, comparable numbers."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord]) -> Summary:
    ok = [r for r in records if r.ok]
    latencies = [r.latency_s for r in ok]
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    span = 0.0
    if ok:
        span = max(r.finished_s for r in ok) - min(r.scheduled_s for r in records)
    return Summary(
        count=len(records),
        ok=len(ok),
        failed=len(records) - len(ok),
        span_s=span,
        throughput_rps=len(ok) / span if span > 0 else 0.0,
        latency_mean_s=sum(latencies) / len(latencies) if latencies else None,
        latency_p50_s=percentile(latencies, 50) if latencies else None,
        latency_p95_s=percentile(latencies, 95) if latencies else None,
        latency_p99_s=percentile(latencies, 99) if latencies else None,
        max_send_lag_s=max(lags) if lags else None,
    )
