"""The run summary against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest

from stepserve.load_tests.metrics import percentile, summarize
from stepserve.load_tests.records import RequestRecord


def rec(index, scheduled, latency, status=200, sent=None, steps=20):
    return RequestRecord(index=index, steps=steps, scheduled_s=scheduled,
                         sent_s=scheduled if sent is None else sent, latency_s=latency, status=status)


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = list(np.random.default_rng(0).exponential(size=57))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_small_samples():
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_counts_throughput_and_latency():
    records = [
        rec(0, 1.0, 2.0),  # finishes at 3
        rec(1, 2.0, 1.0),  # finishes at 3
        rec(2, 3.0, 8.0),  # finishes at 11: the last success
        rec(3, 4.0, 0.5, status=429),  # answered but failed: not a latency sample
        RequestRecord(index=4, steps=40, scheduled_s=5.0, sent_s=5.25, latency_s=None, status=None, error="timeout"),
    ]
    s = summarize(records)
    assert (s.count, s.ok, s.failed) == (5, 3, 2)
    assert s.span_s == pytest.approx(10.0)  # first scheduled (1) to last success (11)
    assert s.throughput_rps == pytest.approx(0.3)
    assert s.latency_mean_s == pytest.approx(11 / 3)
    assert s.latency_p50_s == pytest.approx(2.0)
    assert s.latency_p95_s == pytest.approx(float(np.percentile([2.0, 1.0, 8.0], 95)))
    assert s.latency_p99_s == pytest.approx(float(np.percentile([2.0, 1.0, 8.0], 99)))
    assert s.max_send_lag_s == pytest.approx(0.25)


def test_summary_without_successes_has_no_latency():
    s = summarize([rec(0, 0.0, 1.0, status=500), RequestRecord(1, 10, 1.0, None, None, None, "deadline")])
    assert (s.count, s.ok, s.failed, s.throughput_rps) == (2, 0, 2, 0.0)
    assert s.latency_p50_s is None and s.latency_mean_s is None
    assert s.max_send_lag_s == 0.0  # the unsent request has no lag to report


def test_summary_of_nothing():
    s = summarize([])
    assert (s.count, s.ok, s.failed, s.span_s, s.throughput_rps, s.max_send_lag_s) == (0, 0, 0, 0.0, 0.0, None)
