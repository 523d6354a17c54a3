"""The edge: the admission gate (the router's published load, long-polled) and the one mapping
from router and job-store failures to OpenAI-shaped API errors."""

import asyncio

import pytest
import ray.exceptions

from stepserve.actors.router import RequestCancelledError, RequestDiscardedError, RequestFailedError
from stepserve.deployments import edge
from stepserve.deployments.edge import AdmissionGate, as_api_error, mapped
from stepserve.deployments.errors import APIError
from stepserve.deployments.job_store import JobStore
from stepserve.deployments.jobs import IdempotencyConflict, JobTableFull
from stepserve.policies.admission import ClassLoad, LoadReport
from stepserve.policies.types import RequestKind, RequestSpec
from stepserve.routing.core import DuplicateRequestError, QueueFullError
from tests.cpu.deployments.fakes import ACTOR_ID, LEAKS, LEAKY_TEXT, NODE_IP, PID, FakeRouter, eventually

T2I, T2V = RequestKind.T2I, RequestKind.T2V


def router() -> FakeRouter:
    return FakeRouter(JobStore(ttl_s=60, max_bytes=1 << 20, max_jobs=10))


def reporting(**load) -> FakeRouter:
    """A router whose report has two live workers and this image load."""
    fake = router()
    fake.report = LoadReport(version=1, live_workers=2, classes=images(**load))
    return fake


def spec(request_id: str) -> RequestSpec:
    return RequestSpec(request_id=request_id, model="m", prompt="a cat", width=64, height=64, num_inference_steps=2,
                       guidance_scale=1.0, seed=0)


def images(queued=0, decoding=0, max_queued=3, drain_per_s=None, max_wait_s=None) -> dict:
    return {T2I: ClassLoad(queued=queued, running=0, decoding=decoding, max_queued=max_queued,
                           drain_per_s=drain_per_s, max_wait_s=max_wait_s)}


async def watching(fake: FakeRouter, kind: RequestKind = T2I) -> AdmissionGate:
    """A gate that has let one request in (which starts its watch) and holds the router's report."""
    gate = AdmissionGate(fake)
    await gate.admit(kind, "first")
    return gate


async def refused(gate: AdmissionGate, kind: RequestKind, request_id: str = "req-1", count: int = 1) -> APIError:
    with pytest.raises(APIError) as info:
        await gate.admit(kind, request_id, count)
    return info.value


# -- the admission gate --------------------------------------------------------------------------


def test_the_first_request_waits_for_the_routers_first_answer():
    fake = router()
    fake.report = LoadReport(version=3, live_workers=0)  # refuses everything

    async def scenario():
        gate = AdmissionGate(fake)
        assert gate.report is None
        assert (await refused(gate, T2I)).status == 503  # decided on the router's answer, not without it
        assert fake.load.calls[0] == (-1, gate.id)

    asyncio.run(scenario())


def test_no_answer_from_the_router_is_503_starting(monkeypatch):
    # A router still starting (loading its workers' models) cannot answer: no job may be created
    # that it would then fail as interrupted, and no image may wait on it for a minute.
    monkeypatch.setattr(edge, "FIRST_REPORT_WAIT_S", 0.1)
    fake = router()
    fake.load_error = ray.exceptions.RayActorError()

    async def scenario():
        gate = AdmissionGate(fake)
        for kind in (T2I, T2V):
            error = await refused(gate, kind, "req-3")
            assert (error.status, error.code, error.request_id) == (503, "unavailable", "req-3")
            assert error.headers()["retry-after"] == "5" and "starting" in error.message
        fake.load_error = None  # up now: the watch's next try hears it
        await eventually(lambda: gate.report is not None)
        await gate.admit(T2V, "req-4")

    asyncio.run(scenario())


def test_a_report_over_the_bound_is_429_with_retry_after():
    fake = router()
    fake.report = LoadReport(version=1, live_workers=2, classes=images(queued=6, decoding=2, max_queued=4,
                                                                        drain_per_s=0.5))

    async def scenario():
        gate = await watching(fake, T2V)
        error = await refused(gate, T2I, "req-9")
        assert (error.status, error.code, error.type, error.request_id) == (429, "overloaded", "rate_limit_error",
                                                                           "req-9")
        # Five ahead over the bound (8 in backlog, 4 allowed) drain in 10 s at 0.5 per second.
        assert error.retry_after_s == 10 and error.headers() == {"x-request-id": "req-9", "retry-after": "10"}
        assert "queue is full" in error.message
        await gate.admit(T2V, "video")  # videos are their own class: a full image queue does not shed them

    asyncio.run(scenario())


def test_predicted_wait_over_the_bound_is_429():
    fake = router()
    fake.report = LoadReport(version=1, live_workers=1, classes=images(queued=4, max_queued=100, drain_per_s=1.0,
                                                                        max_wait_s=2.0))

    async def scenario():
        gate = await watching(fake, T2V)
        error = await refused(gate, T2I)
        assert (error.status, error.retry_after_s) == (429, 3.0)  # 5 s predicted, 2 s allowed

    asyncio.run(scenario())


def test_no_live_workers_is_503_with_retry_after():
    fake = router()
    fake.report = LoadReport(version=1, live_workers=0)

    async def scenario():
        gate = AdmissionGate(fake)
        for kind in (T2I, T2V):
            error = await refused(gate, kind)
            assert (error.status, error.code, error.type) == (503, "unavailable", "server_error")
            assert error.headers()["retry-after"] == "5"

    asyncio.run(scenario())


def test_a_burst_on_a_quiet_report_stops_at_the_bound_without_asking_the_router():
    # The router does not republish while its load is quiet, and requests still on their way
    # are in no report: the gate holds them against the bound itself.
    fake = reporting(queued=1, max_queued=6)

    async def scenario():
        gate = AdmissionGate(fake)
        for i in range(5):  # 1 queued + 5 on their way = the bound
            await gate.admit(T2I, f"r{i}")
        assert (await refused(gate, T2I)).status == 429
        assert (await refused(gate, T2I)).status == 429  # a refused request is not on its way
        assert gate.ledger.in_flight(T2I) == 5 and not fake.submit.calls
        await gate.admit(T2V, "video")  # counted per class

    asyncio.run(scenario())


def test_the_n_images_of_one_request_are_admitted_all_or_none():
    fake = reporting(queued=2, max_queued=6)

    async def scenario():
        gate = AdmissionGate(fake)
        assert (await refused(gate, T2I, count=5)).status == 429
        assert gate.ledger.in_flight(T2I) == 0
        await gate.admit(T2I, "four", 4)
        assert gate.ledger.in_flight(T2I) == 4

    asyncio.run(scenario())


def test_what_the_router_received_is_no_longer_on_its_way():
    fake = reporting(queued=0, max_queued=8)

    async def scenario():
        gate = AdmissionGate(fake)
        for i in range(3):
            await gate.admit(T2I, f"r{i}")
            await fake.submit.remote(spec(f"r{i}"), None, gate.id)  # finished at once
        assert gate.ledger.in_flight(T2I) == 3  # the report the gate holds predates them
        fake.publish(classes=images(queued=0, max_queued=8))
        await eventually(lambda: gate.report.version == 2)
        assert gate.report.received == {T2I: 3} and gate.ledger.in_flight(T2I) == 0

    asyncio.run(scenario())


def test_a_gate_that_leaves_quiet_asks_for_a_fresh_report():
    fake = reporting(queued=0, max_queued=8)

    async def scenario():
        gate = AdmissionGate(fake)
        for i in range(3):
            await gate.admit(T2I, f"r{i}")
        await asyncio.sleep(0.1)
        assert fake.load.calls == [(-1, gate.id), (1, gate.id)]  # the long poll only: still quiet
        await gate.admit(T2I, "r3")  # 4 of 8 on their way: no longer quiet
        await eventually(lambda: len(fake.load.calls) == 3)
        assert fake.load.calls[-1] == (-1, gate.id)  # answered at once, beside the long poll

    asyncio.run(scenario())


def test_the_watcher_long_polls_and_forgets_a_failed_router(monkeypatch):
    monkeypatch.setattr(edge, "FIRST_REPORT_WAIT_S", 0.1)
    fake = router()

    async def scenario():
        gate = AdmissionGate(fake)
        await gate.admit(T2I, "r")
        await eventually(lambda: len(fake.load.calls) == 2)
        assert fake.load.calls == [(-1, gate.id), (0, gate.id)]  # then it waits with the version it holds
        await asyncio.sleep(0.2)
        assert len(fake.load.calls) == 2  # nothing changed, nothing exchanged
        full = fake.publish(classes=images(queued=3, max_queued=3))
        await eventually(lambda: gate.report.version == full.version)
        assert (await refused(gate, T2I)).status == 429

        fake.load_error = ray.exceptions.RayActorError()  # the router is restarting
        fake.publish(classes={})
        await eventually(lambda: gate.report is None)  # what it said no longer holds
        assert (await refused(gate, T2I)).status == 503
        fake.load_error = None
        fake.publish(router_id="new")
        await eventually(lambda: gate.report is not None)
        await gate.admit(T2I, "r2")  # the new router answered
        assert gate.report.router_id == "new"

    asyncio.run(scenario())


def test_the_watch_restarts_on_a_new_event_loop():
    # A watch whose task ended (its loop closed, or it crashed) must not leave the gate on a
    # stale report forever: the next request starts it again.
    fake = router()
    gate = AdmissionGate(fake)
    asyncio.run(gate.admit(T2I, "r"))
    report = fake.publish(live_workers=0)

    async def second():
        await gate.admit(T2I, "r")  # stale report (admits); the watch starts again
        await eventually(lambda: gate.report.version == report.version)
        assert (await refused(gate, T2I)).status == 503

    asyncio.run(second())


# -- as_api_error --------------------------------------------------------------------------------


def ray_wrapped(exc: Exception) -> Exception:
    """`exc` as a DeploymentHandle call raises it: a RayTaskError that is also an instance of it."""
    return ray.exceptions.RayTaskError("submit", LEAKY_TEXT, exc, ip=NODE_IP, pid=PID,
                                       actor_id=ACTOR_ID).as_instanceof_cause()


DISCARD_REASON = "cannot meet its deadline: even started now alone it would end denoising 2.50 s after it"
MAPPINGS = [
    # (raised, status, code, type, param, retry_after_s)
    (QueueFullError("the t2i queue is full", 429, 2.2), 429, "overloaded", "rate_limit_error", None, 2.2),
    (QueueFullError("the t2i queue is full", 429, None), 429, "overloaded", "rate_limit_error", None, 1.0),
    (QueueFullError("no worker can serve it", 503, 4.0), 503, "unavailable", "server_error", None, 4.0),
    (DuplicateRequestError("req-1"), 409, "duplicate_request_id", "invalid_request_error", "request_id", None),
    (IdempotencyConflict("key k was used for another body"), 409, "idempotency_key_reused", "invalid_request_error",
     "Idempotency-Key", None),
    (JobTableFull("all 10 job slots are live"), 429, "overloaded", "rate_limit_error", None, 5.0),
    (RequestCancelledError("request req-1 was cancelled"), 409, "cancelled", "invalid_request_error", None, None),
    (RequestFailedError(LEAKY_TEXT), 500, "generation_failed", "server_error", None, None),
    (RequestDiscardedError(DISCARD_REASON), 429, "deadline_unattainable", "rate_limit_error", None, 1.0),
    (RuntimeError(LEAKY_TEXT), 500, "internal_error", "server_error", None, None),
    (KeyError(LEAKY_TEXT), 500, "internal_error", "server_error", None, None),
]


@pytest.mark.parametrize("wrap", [False, True], ids=["raw", "through-ray"])
@pytest.mark.parametrize("raised,status,code,kind,param,retry_after_s", MAPPINGS,
                         ids=[f"{type(m[0]).__name__}-{m[1]}" for m in MAPPINGS])
def test_each_failure_maps_to_its_api_error(wrap, raised, status, code, kind, param, retry_after_s):
    error = as_api_error(ray_wrapped(raised) if wrap else raised, "req-1")
    assert isinstance(error, APIError)
    assert (error.status, error.code, error.type, error.param, error.retry_after_s, error.request_id) == (
        status, code, kind, param, retry_after_s, "req-1")
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    assert error.headers()["x-request-id"] == "req-1"
    if status == 500:  # a fixed message: what went wrong is for the server log
        assert error.message.endswith("(request id: req-1)")
    text = str(error.body()) + str(error.headers()) + str(error)
    for secret in LEAKS:
        assert secret not in text, (secret, text)


@pytest.mark.parametrize("wrap", [False, True], ids=["raw", "through-ray"])
def test_a_discarded_request_is_told_the_policys_reason(wrap):
    raised = RequestDiscardedError(DISCARD_REASON)
    error = as_api_error(ray_wrapped(raised) if wrap else raised, "req-3")
    assert error.message == ("request req-3 cannot meet its deadline under the current load; retry later "
                             f"({DISCARD_REASON})")
    assert error.headers() == {"x-request-id": "req-3", "retry-after": "1"}


@pytest.mark.parametrize("raised", [
    ray.exceptions.RayActorError(),
    ray.exceptions.ActorUnavailableError(f"actor {ACTOR_ID} on {NODE_IP} is unavailable", None),
    ray_wrapped(ray.exceptions.RayActorError()),
], ids=["actor-died", "actor-unavailable", "wrapped"])
def test_a_dead_deployment_is_503_with_retry_after(raised):
    error = as_api_error(raised, "req-7")
    assert (error.status, error.code, error.type) == (503, "unavailable", "server_error")
    assert error.headers() == {"x-request-id": "req-7", "retry-after": "5"}
    assert NODE_IP not in error.message and ACTOR_ID not in error.message and "req-7" in error.message


def test_api_errors_and_cancellation_pass_unchanged():
    given = APIError(400, "bad size", param="size")
    assert as_api_error(given, "req-1") is given
    cancelled = asyncio.CancelledError()
    assert as_api_error(cancelled, "req-1") is cancelled


def test_mapped_awaits_and_maps():
    async def ok():
        return 5

    async def full():
        raise QueueFullError("full", 429, 3.0)

    async def scenario():
        assert await mapped(ok(), "r") == 5
        with pytest.raises(APIError) as info:
            await mapped(full(), "r")
        assert (info.value.status, info.value.retry_after_s, info.value.request_id) == (429, 3.0, "r")
        assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback

    asyncio.run(scenario())
