"""The one summary of a load run, live or simulated: counts, throughput, goodput, SLO
attainment, latency percentiles, queue wait, worker busy fraction. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stepserve.load_tests.records import RequestRecord


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
    # SLO: None when no record carries one. Attainment is over every request with an SLO,
    # failures included (a rejected request missed its SLO); goodput is per second of span.
    slo_count: int = 0
    slo_met: int = 0
    slo_attainment: float | None = None
    goodput_rps: float | None = None
    # Arrival at the router to admission, over the requests where it is known.
    queue_wait_mean_s: float | None = None
    queue_wait_p95_s: float | None = None
    # Busy seconds of all workers over (workers × span); None when busy times are unknown.
    busy_fraction: float | None = None
    offered_rps: float | None = None  # the workload's mean rate, when the caller knows it


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


def summarize(records: Sequence[RequestRecord], busy_s: Mapping[str, float] | None = None,
              offered_rps: float | None = None) -> Summary:
    """`busy_s`: seconds each worker spent executing rounds during the run (the simulator
    knows it exactly; a live run may pass the router's round-time sum)."""
    ok = [r for r in records if r.ok]
    latencies = [r.latency_s for r in ok]
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    span = 0.0
    if ok:
        span = max(r.finished_s for r in ok) - min(r.scheduled_s for r in records)
    with_slo = [r for r in records if r.slo_s is not None]
    met = sum(1 for r in with_slo if r.met_slo)
    waits = [r.queue_wait_s for r in records if r.queue_wait_s is not None]
    busy = None
    if busy_s and span > 0:
        busy = sum(busy_s.values()) / (len(busy_s) * span)
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
        slo_count=len(with_slo),
        slo_met=met,
        slo_attainment=met / len(with_slo) if with_slo else None,
        goodput_rps=(met / span if span > 0 else 0.0) if with_slo else None,
        queue_wait_mean_s=sum(waits) / len(waits) if waits else None,
        queue_wait_p95_s=percentile(waits, 95) if waits else None,
        busy_fraction=busy,
        offered_rps=offered_rps,
    )
