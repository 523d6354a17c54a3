"""The ingress replicas' metrics summed at the router (`actors.replica_metrics`): counters and
histograms add up, a late push never takes a count back, a replica gone keeps its counts, and a
gauge is refused."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stepserve.actors.replica_metrics import ReplicaSums, snapshot


def replica():
    registry = CollectorRegistry()
    requests = Counter("t_requests", "Requests.", ["route"], registry=registry)
    latency = Histogram("t_latency_seconds", "Latency.", buckets=(0.1, 1.0), registry=registry)
    return registry, requests, latency


def published(sums: ReplicaSums) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(sums)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}


def test_two_replicas_counts_and_histograms_add_up():
    (a, a_requests, a_latency), (b, b_requests, b_latency) = replica(), replica()
    a_requests.labels("/x").inc(2)
    b_requests.labels("/x").inc(3)
    b_requests.labels("/y").inc()
    a_latency.observe(0.05)
    b_latency.observe(0.5)
    sums = ReplicaSums()
    sums.update("a", 1, snapshot(a))
    sums.update("b", 1, snapshot(b))
    values = published(sums)
    assert values[("t_requests_total", (("route", "/x"),))] == 5
    assert values[("t_requests_total", (("route", "/y"),))] == 1
    assert values[("t_latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert values[("t_latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert values[("t_latency_seconds_count", ())] == 2 and values[("t_latency_seconds_sum", ())] == pytest.approx(0.55)
    assert not any(name.endswith("_created") for name, _ in values)  # creation times do not add up


def test_a_late_push_is_dropped_and_a_gone_replica_keeps_its_counts():
    registry, requests, _ = replica()
    requests.labels("/x").inc()
    first = snapshot(registry)
    requests.labels("/x").inc()
    sums = ReplicaSums()
    sums.update("a", 2, snapshot(registry))
    sums.update("a", 1, first)  # overtaken on the way
    assert published(sums)[("t_requests_total", (("route", "/x"),))] == 2
    other, more, _ = replica()
    more.labels("/x").inc(5)
    sums.update("b", 1, snapshot(other))  # "a" pushes no more (scaled down): its 2 stay in the sum
    assert published(sums)[("t_requests_total", (("route", "/x"),))] == 7
    assert sums.replicas == 2


def test_a_gauge_does_not_add_up_and_is_refused():
    registry = CollectorRegistry()
    Gauge("t_inflight", "In flight.", registry=registry).set(3)
    with pytest.raises(ValueError, match="t_inflight is a gauge"):
        snapshot(registry)
