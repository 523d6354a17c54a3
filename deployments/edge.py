"""What every request meets at the ingress before the router: the admission gate and the one
mapping from internal failures to the OpenAI error shape.

The gate sheds overload in milliseconds from the router's published load (a long poll: the
router answers when its load changes in a way the edge must hear, which far from every bound
it does not (`admission.is_quiet`), so an idle or lightly loaded app exchanges one call every
few seconds), before any work is spent; the router applies the same rule again on submit, so a
stale copy here never lets more through than the bound.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from stepserve.actors.router import RequestCancelledError, RequestDiscardedError, RequestFailedError
from stepserve.actors.router_core import DuplicateRequestError, QueueFullError
from stepserve.deployments.errors import APIError, server_error
from stepserve.deployments.jobs import IdempotencyConflict, JobTableFull
from stepserve.policies.admission import LoadReport, admit
from stepserve.policies.types import RequestKind

logger = logging.getLogger("stepserve.edge")

POLL_GAP_S = 0.05  # at most this often under load: the report changes with every admission and finish
ROUTER_RETRY_S = 5.0
# Nothing predicts when the load that made the scheduler give a request up eases: the least
# whole second, as the admission rule says when it has no prediction either.
DISCARD_RETRY_S = 1.0


class AdmissionGate:
    def __init__(self, router: Any) -> None:
        self.router = router
        self.report: LoadReport | None = None
        self._pending = dict.fromkeys(RequestKind, 0)  # let in since the report was taken
        self._task: asyncio.Task | None = None

    def check(self, kind: RequestKind, request_id: str) -> None:
        """Raise a 429/503 `APIError` when the router's last published load says no."""
        self._start()
        if self.report is None:
            return  # no report yet (just started): the router decides alone
        verdict = admit(self.report, kind, self._pending[kind])
        if not verdict.admitted:
            raise APIError(verdict.status, verdict.message, code="overloaded" if verdict.status == 429 else
                           "unavailable", type="rate_limit_error" if verdict.status == 429 else "server_error",
                           request_id=request_id, retry_after_s=verdict.retry_after_s)
        self._pending[kind] += 1

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        version = -1
        while True:
            try:
                report = await self.router.load.remote(version)
            except Exception as exc:  # the router is restarting: keep the last report, try again
                logger.warning("router load unavailable (%s); retrying", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            if report.version != version:
                self._pending = dict.fromkeys(RequestKind, 0)
            self.report, version = report, report.version
            await asyncio.sleep(POLL_GAP_S)


def as_api_error(exc: BaseException, request_id: str) -> BaseException:
    """Router and job-store outcomes as API errors; `asyncio.CancelledError` passes unchanged.
    Anything unexpected becomes a 500 that names the request id and nothing else: the details
    (a traceback, a node IP, an actor id) go to the server log."""
    if isinstance(exc, (APIError, asyncio.CancelledError)):
        return exc
    if isinstance(exc, QueueFullError):
        kind = "rate_limit_error" if exc.status == 429 else "server_error"
        return APIError(exc.status, exc.message, code="overloaded" if exc.status == 429 else "unavailable",
                        type=kind, request_id=request_id, retry_after_s=exc.retry_after_s or 1.0)
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
