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


def slo_rec(index, scheduled, latency, slo, status=200, wait=None):
    return RequestRecord(index=index, steps=20, scheduled_s=scheduled, sent_s=scheduled, latency_s=latency,
                         status=status, slo_s=slo, queue_wait_s=wait)


def test_slo_attainment_goodput_and_queue_wait():
    records = [
        slo_rec(0, 0.0, 2.0, slo=3.0, wait=0.5),  # met
        slo_rec(1, 1.0, 3.0, slo=3.0, wait=1.0),  # met exactly at the deadline
        slo_rec(2, 2.0, 8.0, slo=4.0, wait=3.0),  # late: finishes at 10, the last success
        slo_rec(3, 3.0, 0.1, slo=4.0, status=429),  # rejected: a miss, not a latency sample
        RequestRecord(4, 20, 4.0, 4.0, None, None, "timeout", slo_s=5.0),  # no answer: a miss
    ]
    s = summarize(records, busy_s={"w0": 5.0, "w1": 2.5}, offered_rps=0.5)
    assert (s.slo_count, s.slo_met) == (5, 2)
    assert s.slo_attainment == pytest.approx(0.4)
    assert s.span_s == pytest.approx(10.0)
    assert s.goodput_rps == pytest.approx(0.2)
    assert s.throughput_rps == pytest.approx(0.3)
    assert s.queue_wait_mean_s == pytest.approx(4.5 / 3)
    assert s.queue_wait_p95_s == pytest.approx(float(np.percentile([0.5, 1.0, 3.0], 95)))
    assert s.busy_fraction == pytest.approx(7.5 / (2 * 10.0))
    assert s.offered_rps == 0.5
    assert [r.met_slo for r in records] == [True, True, False, False, False]


def test_without_slos_or_busy_times_those_fields_are_none():
    s = summarize([rec(0, 0.0, 1.0)])
    assert s.slo_attainment is None and s.goodput_rps is None and s.slo_count == 0
    assert s.queue_wait_mean_s is None and s.busy_fraction is None
    assert rec(0, 0.0, 1.0).met_slo is None


def test_simulated_and_live_records_share_one_summary():
    """A simulated run's records go through the same summarize as live ones."""
    from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
    from stepserve.load_tests.workload import ScheduledRequest

    from tests.cpu.load_tests.costs import ConstantCost

    requests = [ScheduledRequest(index=i, offset_s=3.0 * i, num_inference_steps=2, seed=i, width=64, height=64,
                                 guidance_scale=7.5, prompt="p", model="sd", slo_s=3.5) for i in range(3)]
    config = SimConfig(workers=1, text_encoder=TextEncoderSpec(batch_wait_s=0.0))
    result = simulate(requests, ConstantCost(encode_s=0.0, decode_s=0.5), config)
    # Each request alone: 2 rounds of 1 s then 0.5 s of decode, from its arrival: 2.5 s, within 3.5 s.
    s = result.summary()
    assert s.latency_p50_s == pytest.approx(2.5)
    assert s.slo_attainment == 1.0 and s.queue_wait_mean_s == pytest.approx(0.0)
    assert s.busy_fraction == pytest.approx(6.0 / (6.0 + 2.5))
