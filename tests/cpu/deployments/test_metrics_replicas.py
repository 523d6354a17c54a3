"""`/metrics` with two ingress replicas: whichever replica a scrape reaches, it publishes every
replica's HTTP counts summed at the router, so a counter never goes back between scrapes."""

from types import SimpleNamespace

import pytest
import ray.serve
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from stepserve.deployments import ingress as ingress_module
from tests.cpu.deployments.fakes import INGRESS, StoreHandle, build, wait_until

CAT = {"prompt": "a cat", "size": "64x64"}


def http_requests(text: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "stepserve_http_requests_total")


@pytest.fixture
def replicas(monkeypatch):
    """Two ingress replicas over one router, and a client whose next request goes to `serving[0]`."""
    monkeypatch.setattr(ingress_module, "PUSH_DELAY_S", 0.01)
    app = build()
    second = INGRESS(app.config, app.router, StoreHandle(app.store), app.text_encoder)
    serving = [app.ingress]
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=serving[0]))
    with TestClient(ingress_module.api, raise_server_exceptions=False) as client:
        yield client, (app.ingress, second), serving, app.router


def test_every_scrape_sums_both_replicas_and_counters_never_go_back(replicas):
    client, ingresses, serving, router = replicas
    seen, sent = [], 0
    for i in range(8):
        serving[0] = ingresses[i % 2]  # the load balancer alternates
        for _ in range(i + 1):
            assert client.post("/v1/images/generations", json=CAT).status_code == 200
            sent += 1
        # Every request so far, both replicas', reaches the router within the push delay.
        wait_until(lambda: http_requests(router._metrics_text().decode()) == sent)
        serving[0] = ingresses[(i + 1) % 2]  # scraped through the other replica
        response = client.get("/metrics")
        assert response.status_code == 200
        seen.append(http_requests(response.text))
        assert seen[-1] == sent
    assert seen == sorted(seen)


def test_a_scrape_still_answers_when_its_push_fails(replicas, caplog):
    client, (first, _), serving, router = replicas
    assert client.post("/v1/images/generations", json=CAT).status_code == 200
    router.ingress_metrics.fn = lambda *args: (_ for _ in ()).throw(RuntimeError("router busy"))
    response = client.get("/metrics")
    assert response.status_code == 200 and "stepserve_router_rounds 7" in response.text
    assert "could not push this ingress replica's metrics" in caplog.text
