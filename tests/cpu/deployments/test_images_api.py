"""POST /v1/images/generations through the real `Ingress`: bodies, idempotent retries (the real
job store remembers results), errors that leak nothing, and bad text that harms no one else.

The router is a test double (the real one runs in the live integration tests).
"""

import asyncio
import base64

import httpx
import pytest
import ray.exceptions
from prometheus_client.parser import text_string_to_metric_families

from stepserve.actors.router import RequestFailedError
from stepserve.deployments import images as images_module
from stepserve.deployments import ingress as ingress_module
from stepserve.deployments.errors import APIError
from stepserve.deployments.images import request_id_for
from stepserve.deployments.protocol import ImageGenerationRequest
from stepserve.deployments.videos import key_seed
from stepserve.policies.admission import ClassLoad
from stepserve.policies.types import RequestKind
from stepserve.routing.core import QueueFullError
from tests.cpu.deployments.fakes import (
    LEAKY_TEXT,
    ManualClock,
    assert_error,
    assert_no_leak,
    build,
    eventually,
    fake_png,
    http_client,
    wait_until,
    point_serve_at,
    settle,
)

CAT = {"prompt": "a cat", "size": "64x64"}


def async_client(app, monkeypatch) -> httpx.AsyncClient:
    """HTTP on the test's own event loop, for requests that must be in flight together."""
    point_serve_at(app.ingress, monkeypatch)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress_module.api), base_url="http://testserver")


def test_a_generation_returns_b64_pngs_with_their_seeds(http, router):
    response = http.post("/v1/images/generations", json={**CAT, "n": 2, "seed": 5, "num_inference_steps": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["created"], int) and [d["seed"] for d in body["data"]] == [5, 6]
    rid0, rid1 = router.submitted
    assert rid0.startswith("img-") and (rid0[-2:], rid1) == ("-0", rid0[:-2] + "-1")
    for item, rid in zip(body["data"], router.submitted):
        assert set(item) == {"b64_json", "seed"}
        assert base64.b64decode(item["b64_json"]) == fake_png(router.specs[rid])
        spec = router.specs[rid]
        assert (spec.width, spec.height, spec.num_inference_steps, spec.prompt) == (64, 64, 3, "a cat")
    # Without a seed (and a key), one is drawn at random and reported.
    (item,) = http.post("/v1/images/generations", json=CAT).json()["data"]
    assert 0 <= item["seed"] < 2**31


def test_a_retry_after_success_gets_the_stored_body(app, http, router):
    key = {"Idempotency-Key": "cat-1"}
    first = http.post("/v1/images/generations", json=CAT, headers=key)
    assert first.status_code == 200
    again = http.post("/v1/images/generations", json=CAT, headers=key)
    assert again.status_code == 200 and again.json() == first.json()
    assert len(router.submitted) == 1  # the retry never reached the router
    assert settle(app.store.stats())["images"] == 1
    # The same key with another body is a client bug, not a retry.
    other = http.post("/v1/images/generations", json={**CAT, "prompt": "a dog"}, headers=key)
    error = assert_error(other, 409, "idempotency_key_reused", "Idempotency-Key")
    assert "different request body" in error["message"]
    assert len(router.submitted) == 1
    # Another key is another request.
    assert http.post("/v1/images/generations", json=CAT, headers={"Idempotency-Key": "cat-2"}).status_code == 200
    assert len(router.submitted) == 2


def test_a_stored_body_expires_with_the_job_ttl(monkeypatch):
    clock = ManualClock()
    app = build(clock, jobs={"ttl_s": 60})
    key = {"Idempotency-Key": "cat-ttl"}
    with http_client(app.ingress, monkeypatch) as http:
        first = http.post("/v1/images/generations", json=CAT, headers=key).json()
        clock.now += 59
        assert http.post("/v1/images/generations", json=CAT, headers=key).json() == first
        clock.now += 1
        assert http.post("/v1/images/generations", json=CAT, headers=key).status_code == 200
        assert len(app.router.submitted) == 2  # forgotten: the retry is served anew


def test_without_a_seed_the_same_key_draws_the_same_seed(http, router):
    key = {"Idempotency-Key": "seedless"}
    router.refuse = QueueFullError("the t2i queue is full", 429, 1.0)
    assert_error(http.post("/v1/images/generations", json=CAT, headers=key), 429, "overloaded")
    router.refuse = None
    body = http.post("/v1/images/generations", json=CAT, headers=key).json()
    (refused, *_), (served, *_) = router.submit.calls
    # Same request id and seed: the retry is the same request (it would join a live first try).
    assert (refused.request_id, refused.seed) == (served.request_id, served.seed) == (
        request_id_for("seedless"), key_seed("seedless"))
    assert body["data"][0]["seed"] == served.seed
    other = http.post("/v1/images/generations", json=CAT, headers={"Idempotency-Key": "another"}).json()
    assert other["data"][0]["seed"] != served.seed


def test_a_retry_while_the_first_runs_joins_it(app, monkeypatch):
    router = app.router
    router.hold_images = True
    key = {"Idempotency-Key": "joined"}

    async def scenario():
        async with async_client(app, monkeypatch) as client:
            first = asyncio.create_task(client.post("/v1/images/generations", json=CAT, headers=key))
            await eventually(lambda: router.live)
            second = asyncio.create_task(client.post("/v1/images/generations", json=CAT, headers=key))
            await eventually(lambda: len(router.submit.calls) == 2)
            (rid,) = router.live
            router.release(rid)
            a, b = await first, await second
        assert a.status_code == b.status_code == 200
        assert a.json()["data"] == b.json()["data"] and router.submitted == [rid]

    asyncio.run(scenario())


@pytest.mark.parametrize("key", [" ", "k" * 257])
def test_bad_idempotency_keys_are_400(http, router, key):
    response = http.post("/v1/images/generations", json=CAT, headers={"Idempotency-Key": key})
    assert_error(response, 400, "invalid_value", "Idempotency-Key")
    assert not router.submit.calls


@pytest.mark.parametrize("raised,status,code", [
    (RuntimeError(LEAKY_TEXT), 500, "internal_error"),
    (RequestFailedError(LEAKY_TEXT), 500, "generation_failed"),
    (ValueError(LEAKY_TEXT), 500, "internal_error"),
])
def test_5xx_bodies_hold_nothing_of_the_failure(http, router, raised, status, code):
    router.refuse = raised
    for headers in ({}, {"Idempotency-Key": "k"}):
        response = http.post("/v1/images/generations", json=CAT, headers=headers)
        assert_error(response, status, code)
        request_id = assert_no_leak(response)
        assert request_id.startswith("img-")
    assert request_id == request_id_for("k")  # the id a client can quote is its request's


def test_a_router_that_stays_dead_is_503_with_retry_after(http, router, monkeypatch):
    monkeypatch.setattr(images_module, "ROUTER_RESTART_WAIT_S", 0.05)
    monkeypatch.setattr(images_module, "RESUBMIT_PAUSE_S", 0.01)

    async def dead(spec, inputs, gate):
        raise ray.exceptions.RayActorError(error_msg=LEAKY_TEXT)

    router.submit.fn = dead
    response = http.post("/v1/images/generations", json=CAT)
    assert_error(response, 503, "unavailable")
    assert_no_leak(response)
    assert response.headers["retry-after"] == "5"
    assert len(router.submit.calls) > 1  # it was submitted again meanwhile


def test_an_image_the_router_died_holding_is_submitted_again_to_the_next_router(http, router, monkeypatch):
    monkeypatch.setattr(images_module, "RESUBMIT_PAUSE_S", 0.01)
    accept = router.submit.fn
    deaths = []

    async def restarting(spec, inputs, gate):
        if len(deaths) < 2:  # the old router dies holding it; the next call finds the new one starting
            deaths.append(spec.request_id)
            raise (ray.exceptions.RayActorError() if not deaths[:-1] else
                   ray.exceptions.ActorUnavailableError("the router is starting", None))
        return await accept(spec, inputs, gate)

    router.submit.fn = restarting
    response = http.post("/v1/images/generations", json={**CAT, "seed": 3})
    assert response.status_code == 200 and response.json()["data"][0]["seed"] == 3
    assert len(set(deaths)) == 1 and router.submitted == deaths[:1]  # one request, denoised once it took


def test_a_failed_sibling_frees_the_others(http, router):
    router.hold_images = True
    accept = router.submit.fn

    async def second_fails(spec, inputs, gate):
        if spec.request_id.endswith("-1"):
            raise RuntimeError(LEAKY_TEXT)
        return await accept(spec, inputs, gate)

    router.submit.fn = second_fails
    response = http.post("/v1/images/generations", json={**CAT, "n": 2})
    assert_no_leak(response)
    (held,) = router.submitted
    assert held.endswith("-0") and router.cancelled == [held] and not router.live


def test_metrics_and_ready_failures_leak_nothing(http, router, app):
    def broken():
        raise RuntimeError(LEAKY_TEXT)

    router.metrics_text.fn = broken
    assert_no_leak(http.get("/metrics"))
    router.readiness.fn = broken
    response = http.get("/ready")
    assert_error(response, 503, "not_ready")
    assert_no_leak(response)


def test_an_error_goes_by_the_clients_request_id_when_it_gives_a_sane_one(http, router, app):
    """A client's `x-request-id` (Serve's proxy passes it on, and tags the replicas' log lines of
    the request with it) names the request in its error; one that is no plain token does not."""
    def broken():
        raise RuntimeError(LEAKY_TEXT)

    router.metrics_text.fn = broken
    given = http.get("/metrics", headers={"x-request-id": "client-7f3a:retry.2"})
    assert assert_no_leak(given) == "client-7f3a:retry.2"
    for odd in ("a" * 129, "two words", "<script>"):
        assert assert_no_leak(http.get("/metrics", headers={"x-request-id": odd})).startswith("req-")
    assert http.post("/v1/images/generations", json=CAT).status_code == 200  # the gate now holds a report
    full = router.publish(classes={RequestKind.T2I: ClassLoad(queued=4, running=2, decoding=0, max_queued=4,
                                                               drain_per_s=None)})
    wait_until(lambda: app.ingress.gate.report.version == full.version)
    shed = http.post("/v1/images/generations", json=CAT, headers={"x-request-id": "client-8"})
    assert_error(shed, 429, "overloaded")
    assert shed.headers["x-request-id"] == "client-8"


def test_ready_needs_a_live_worker_and_the_text_encoder(http, router, app):
    response = http.get("/ready")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "workers": 2, "live_workers": 2, "queued": 0, "running": 0}
    router.readiness_state["live_workers"] = 0
    response = http.get("/ready")
    assert_error(response, 503, "not_ready")
    assert response.headers["retry-after"] == "1"
    router.readiness_state["live_workers"] = 1
    app.text_encoder.alive = False
    assert_error(http.get("/ready"), 503, "not_ready")
    app.text_encoder.alive = True
    assert http.get("/ready").status_code == 200


def test_http_metrics_count_requests_by_route_and_code(http):
    http.post("/v1/images/generations", json=CAT)
    http.post("/v1/images/generations", json={"prompt": ""})
    http.post("/v1/images/generations", json={"prompt": ""})
    text = http.get("/metrics").text
    counts = {(s.labels["route"], s.labels["code"]): s.value for family in text_string_to_metric_families(text)
              for s in family.samples if s.name == "stepserve_http_requests_total"}
    assert counts == {("/v1/images/generations", "200"): 1, ("/v1/images/generations", "400"): 2}
    assert "stepserve_router_rounds 7" in text  # the router's own series follow


@pytest.mark.parametrize("raw,param", [
    (rb'{"prompt": "\ud800"}', "prompt"),
    (rb'{"prompt": "a cat \udfff"}', "prompt"),
    (rb'{"prompt": "a cat", "negative_prompt": "\ud83e"}', "negative_prompt"),
])
def test_a_lone_surrogate_is_400_while_a_concurrent_request_succeeds(app, monkeypatch, raw, param):
    router = app.router
    router.hold_images = True

    async def scenario():
        async with async_client(app, monkeypatch) as client:
            good = asyncio.create_task(client.post("/v1/images/generations", json=CAT))
            await eventually(lambda: router.live)  # the good request is at the router, mid-flight
            bad = await client.post("/v1/images/generations", content=raw,
                                    headers={"content-type": "application/json"})
            error = assert_error(bad, 400, "invalid_value", param)
            assert "unpaired surrogate" in error["message"]
            (rid,) = router.live
            router.release(rid)
            response = await good
        assert response.status_code == 200 and len(response.json()["data"]) == 1
        assert router.submitted == [rid]  # the bad text never reached the router (nor its text encoder)

    asyncio.run(scenario())


def test_handle_methods_share_the_http_code(app):
    ingress, router = app.ingress, app.router

    async def scenario():
        body = await ingress.generate(ImageGenerationRequest(prompt="a cat", size="64x64", seed=1), "handle-1")
        assert body["data"][0]["seed"] == 1
        assert await ingress.generate({**CAT, "seed": 1}, "handle-1") == body  # remembered under the id
        assert len(router.submitted) == 1
        router.hold_images = True
        single = asyncio.create_task(ingress.generate(CAT, "handle-2"))
        await eventually(lambda: len(router.live) == 1)
        progress = await ingress.progress("handle-2")
        assert (progress["status"], progress["steps_done"], progress["steps_total"]) == ("queued", 0, 30)
        pair = asyncio.create_task(ingress.generate({**CAT, "n": 2}, "handle-3"))
        await eventually(lambda: len(router.live) == 3)
        assert await ingress.cancel("handle-3")  # every sibling of the client's request
        assert await ingress.cancel("handle-2")
        for call in (single, pair):
            with pytest.raises(APIError) as info:
                await call
            assert (info.value.status, info.value.code) == (409, "cancelled")
        assert not router.live and not await ingress.cancel("handle-3")
        assert await ingress.progress("handle-2") is None  # forgotten once ended
        with pytest.raises(APIError) as info:
            await ingress.generate({"prompt": "a cat", "size": "65x65"})
        assert (info.value.status, info.value.param) == (400, "size")

    asyncio.run(scenario())


def test_overload_is_shed_before_the_body_is_read(app, http, router):
    assert http.post("/v1/images/generations", json=CAT).status_code == 200  # the gate now holds a report
    full = router.publish(classes={RequestKind.T2I: ClassLoad(queued=4, running=2, decoding=0, max_queued=4,
                                                               drain_per_s=None)})
    wait_until(lambda: app.ingress.gate.report.version == full.version)
    # Not even parsed: a burst's refusals cost the ingress no body read and no checks.
    response = http.post("/v1/images/generations", content=b"{not json")
    assert_error(response, 429, "overloaded")
    assert response.headers["retry-after"] == "1" and response.headers["x-request-id"].startswith("req-")
    assert_error(http.post("/v1/images/edits", content=b"{not json"), 429, "overloaded")
    # A retry with an Idempotency-Key may have its answer stored: it goes the whole way.
    assert_error(http.post("/v1/images/generations", content=b"{not json", headers={"Idempotency-Key": "k"}), 400,
                 "invalid_json")
