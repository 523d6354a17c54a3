"""What every request meets at the ingress before the router: the admission gate and the one
mapping from internal failures to the OpenAI error shape.

The gate sheds overload from the router's load before any work is spent on it. It
long-polls the router's `LoadReport` (the router answers when its load changes in a way the edge
must hear, which far from every bound it does not, so an idle or lightly loaded app exchanges
one call every few seconds) and counts what it let in since (`EdgeLedger`): a burst is cut at
the queue bound here, without a router round trip, whatever the last report said. The router
applies the same rule again on submit, so nothing ever gets past the bound.

Until the router has answered once (it is starting, or restarting) nothing is let in: a request
waits a moment for it and is then refused 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray

from stepserve.actors.router import RequestCancelledError, RequestDiscardedError, RequestFailedError
from stepserve.deployments.errors import APIError, server_error
from stepserve.deployments.jobs import IdempotencyConflict, JobTableFull
from stepserve.policies.admission import EdgeLedger, LoadReport, Verdict
from stepserve.policies.types import RequestKind
from stepserve.routing.core import DuplicateRequestError, QueueFullError

logger = logging.getLogger("stepserve.edge")

POLL_GAP_S = 0.05  # at most this often under load: the report changes with every admission and finish
ROUTER_RETRY_S = 5.0
# A router that is up answers the first poll at once; one that has not answered in this long is
# starting (loading its workers' models can take a minute): refuse rather than hold the client.
FIRST_REPORT_WAIT_S = 2.0
REPORT_CHECK_S = 0.01
# Nothing predicts when the load that made the scheduler give a request up eases: the least
# whole second, as the admission rule says when it has no prediction either.
DISCARD_RETRY_S = 1.0


class AdmissionGate:
    def __init__(self, router: Any) -> None:
        self.router = router
        self.id = f"edge-{uuid.uuid4().hex[:12]}"  # the router counts what it received from this gate
        self.ledger = EdgeLedger()
        self._task: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None
        self._refreshed_at = -POLL_GAP_S

    @property
    def report(self) -> LoadReport | None:
        return self.ledger.report

    async def ready(self, request_id: str) -> None:
        """Return once the router has answered; a 503 `APIError` if it does not answer soon."""
        self._start()
        deadline = time.monotonic() + FIRST_REPORT_WAIT_S
        while self.ledger.report is None:
            if time.monotonic() >= deadline:
                raise server_error(request_id, "unavailable", "the server is starting; retry shortly", status=503,
                                   retry_after_s=ROUTER_RETRY_S)
            await asyncio.sleep(REPORT_CHECK_S)

    async def admit(self, kind: RequestKind, request_id: str, count: int = 1) -> None:
        """Let `count` requests of `kind` in, all or none, or raise a 429/503 `APIError`. What is
        let in must be submitted to the router at once, naming `self.id`."""
        await self.ready(request_id)
        verdict = self.ledger.admit(kind, time.monotonic(), count)
        if not verdict.admitted:
            raise refusal(verdict, request_id)
        if self.ledger.stale:
            self._ask_again()

    def shed(self, kind: RequestKind, request_id: str) -> None:
        """Refuse a request of `kind` at once, before its body is read, when the last report
        already refuses one more: under a burst the body's read and checks cost the ingress
        more than everything else it does for a refused request."""
        if self.ledger.report is not None:
            verdict = self.ledger.verdict(kind)
            if not verdict.admitted:
                raise refusal(verdict, request_id)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        version = -1
        while True:
            try:
                report = await self.router.load.remote(version, self.id)
            except Exception as exc:  # the router is restarting: what it said no longer holds
                logger.warning("router load unavailable (%s); retrying", type(exc).__name__)
                self.ledger.forget()
                version = -1
                await asyncio.sleep(1.0)
                continue
            self.ledger.observe(report, time.monotonic())
            version = report.version
            await asyncio.sleep(POLL_GAP_S)

    def _ask_again(self) -> None:
        """A fresh report now, beside the long poll (which waits for the router to publish, and a
        quiet router does not): at most one at a time, at most every POLL_GAP_S."""
        now = time.monotonic()
        if (self._refresh is not None and not self._refresh.done()) or now - self._refreshed_at < POLL_GAP_S:
            return
        self._refreshed_at = now
        self._refresh = asyncio.get_running_loop().create_task(self._fetch())

    async def _fetch(self) -> None:
        try:
            self.ledger.observe(await self.router.load.remote(-1, self.id), time.monotonic())
        except Exception as exc:  # the watch notices too, and forgets the report
            logger.warning("router load unavailable (%s)", type(exc).__name__)


def refusal(verdict: Verdict, request_id: str) -> APIError:
    return shed_error(verdict.status, verdict.message, request_id, verdict.retry_after_s)


def shed_error(status: int, message: str, request_id: str, retry_after_s: float | None) -> APIError:
    """Load shed by admission, at the edge or the router: 429 over capacity, 503 nothing to serve it."""
    overloaded = status == 429
    return APIError(status, message, code="overloaded" if overloaded else "unavailable",
                    type="rate_limit_error" if overloaded else "server_error", request_id=request_id,
                    retry_after_s=retry_after_s)


def as_api_error(exc: BaseException, request_id: str) -> BaseException:
    """Router and job-store outcomes as API errors; `asyncio.CancelledError` passes unchanged.
    Anything unexpected becomes a 500 that names the request id and nothing else: the details
    (a traceback, a node IP, an actor id) go to the server log."""
    if isinstance(exc, (APIError, asyncio.CancelledError)):
        return exc
    if isinstance(exc, QueueFullError):
        return shed_error(exc.status, exc.message, request_id, exc.retry_after_s or 1.0)
    if isinstance(exc, DuplicateRequestError):
        return APIError(409, f"request {request_id} is already in progress with a different body",
                        param="request_id", code="duplicate_request_id", request_id=request_id)
    if isinstance(exc, IdempotencyConflict):
        return APIError(409, "this Idempotency-Key was already used with a different request body",
                        param="Idempotency-Key", code="idempotency_key_reused", request_id=request_id)
    if isinstance(exc, JobTableFull):
        return APIError(429, "too many video jobs are live; retry later", code="overloaded",
                        type="rate_limit_error", request_id=request_id, retry_after_s=ROUTER_RETRY_S)
    if isinstance(exc, RequestCancelledError):
        return APIError(409, f"request {request_id} was cancelled", code="cancelled", request_id=request_id)
    if isinstance(exc, RequestDiscardedError):
        # Load shed by the scheduler, as the gate sheds it by queue bounds: a 429 too.
        return APIError(429, f"request {request_id} cannot meet its deadline under the current load; retry later "
                        f"({exc.message})", code=exc.code, type="rate_limit_error", request_id=request_id,
                        retry_after_s=DISCARD_RETRY_S)
    if isinstance(exc, RequestFailedError):
        logger.error("request %s failed: %s", request_id, exc)
        return server_error(request_id, "generation_failed", "generation failed")
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        logger.error("request %s: a deployment it needed died: %r", request_id, exc)
        return server_error(request_id, "unavailable", "the server is restarting a component; retry",
                            status=503, retry_after_s=ROUTER_RETRY_S)
    logger.error("request %s failed unexpectedly", request_id, exc_info=exc)
    return server_error(request_id)


async def mapped(call: Any, request_id: str) -> Any:
    """Await `call`, turning whatever it raises into an API error."""
    try:
        return await call
    except BaseException as exc:
        raise as_api_error(exc, request_id) from None
