"""The router: a thin async shell around `RouterCore`.

It owns the denoiser workers and runs one loop per worker: ask the core for a plan, send it,
apply the report (schedule / execute / update). It asks the text encoder for embeddings while
a request waits and hands only object refs to workers. A plain class: `build_app` deploys it
as a single-replica Serve deployment, so Serve health-checks and restarts it, and the workers
it owns share its fate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from ..engine.families import ModelSource
from ..policies import make_policy
from ..policies.types import RequestSpec, RequestStatus, StepReport
from .metrics import RouterMetrics
from .pool import WorkerPoolSpec, start_workers
from .router_core import RouterCore, WorkerSlot

logger = logging.getLogger("stepserve.router")


class RequestFailedError(RuntimeError):
    """A request could not be completed (worker crash, encoder error, step failure)."""


class RequestCancelledError(RuntimeError):
    pass


async def encode_texts(text_encoder: Any, spec: Any) -> ray.ObjectRef:
    """Ask the text encoder for a request's (prompt, negative-or-None) embeddings; returns the
    ref workers take, once the encoding has succeeded (its error is raised here, before a worker
    depends on the ref). The negative prompt is encoded only under CFG."""
    negative = spec.negative_prompt if spec.uses_cfg else None
    ref = await text_encoder.encode.remote(spec.model, spec.prompt, negative)._to_object_ref()
    await ref
    return ref


class Router:
    # Async so the replica reports healthy only once every worker has loaded its models (Serve
    # awaits async constructors); this class is only ever built as a Serve deployment.
    async def __init__(self, models: Sequence[ModelSource], pool: WorkerPoolSpec, policy: str,
                 policy_options: dict[str, Any], max_queue_len: int, text_encoder: Any, pipeline_depth: int = 2,
                 name: str = "stepserve"):
        self.text_encoder = text_encoder
        self.pipeline_depth = pipeline_depth
        self.workers = start_workers(pool, models, name)
        slots = [WorkerSlot(wid, pool.max_batch_size) for wid in self.workers]
        self.core = RouterCore(make_policy(policy, policy_options), slots, max_queue_len)
        self.metrics = RouterMetrics()
        self._specs: dict[str, RequestSpec] = {}
        self._embeds: dict[str, ray.ObjectRef] = {}
        self._results: dict[str, asyncio.Future] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._loops: list[asyncio.Task] = []
        await self.ready()

    # -- public methods (called through a DeploymentHandle) ------------------------------

    async def ready(self) -> bool:
        """True once every worker has loaded its models."""
        await asyncio.gather(*(w.ready.remote() for w in self.workers.values()))
        return True

    async def submit(self, spec: RequestSpec) -> np.ndarray:
        """Queue a request and return its final latents [1, C, h, w] when denoising ends."""
        self._start_loops()
        self.core.submit(spec, time.monotonic())  # QueueFullError / DuplicateRequestError go to the caller
        rid = spec.request_id
        self._specs[rid] = spec
        self._results[rid] = asyncio.get_running_loop().create_future()
        self._update_gauges()
        encoding = asyncio.create_task(self._encode(spec))
        try:
            return await self._results[rid]
        except asyncio.CancelledError:  # the caller went away: free the slot at the next step
            self.cancel(rid)
            raise
        finally:
            encoding.cancel()
            self._specs.pop(rid, None)
            self._embeds.pop(rid, None)
            self._results.pop(rid, None)
            if self.core.state(rid).status.is_terminal:
                self.core.forget(rid)

    def cancel(self, request_id: str) -> bool:
        cancelled = self.core.cancel(request_id, time.monotonic())
        if cancelled:
            self.metrics.requests.labels("cancelled").inc()
            self._fail(request_id, RequestCancelledError(f"request {request_id} was cancelled"))
            self._wake_all()
        return cancelled

    def progress(self, request_id: str) -> dict[str, Any] | None:
        try:
            state = self.core.state(request_id)
        except KeyError:
            return None
        return {"status": state.status.value, "steps_done": state.steps_done, "steps_total": state.steps_total}

    def stats(self) -> dict[str, int]:
        return {"queue_length": self.core.queue_length, "running": self.core.num_running,
                "workers": len(self.workers)}

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def check_health(self) -> None:
        """Serve's health hook: a dead worker loop means the replica must be replaced."""
        for task in self._loops:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"worker loop died: {task.exception()!r}")

    # -- internals -------------------------------------------------------------------------

    def _start_loops(self) -> None:
        if self._loops:
            return
        for wid in self.workers:
            self._wake[wid] = asyncio.Event()
            self._loops.append(asyncio.create_task(self._worker_loop(wid), name=f"loop-{wid}"))

    def _wake_all(self) -> None:
        for event in self._wake.values():
            event.set()

    async def _encode(self, spec: RequestSpec) -> None:
        rid = spec.request_id
        try:
            ref = await encode_texts(self.text_encoder, spec)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._finish_failed([rid], f"text encoding failed: {exc}")
            return
        self._embeds[rid] = ref
        self.core.mark_ready(rid)
        self._wake_all()

    async def _worker_loop(self, wid: str) -> None:
        """Keep up to `pipeline_depth` plans queued at the worker.

        A plan's outcome is known in advance (every listed request advances one step), so the
        next plan can be made and sent while the current one runs: the worker never idles for a
        round trip. Ray runs one caller's calls to an actor in order; requests that finished in
        an earlier plan are simply skipped by the worker. The price: a newcomer may join one
        step later than with depth 1.
        """
        worker, wake = self.workers[wid], self._wake[wid]
        in_flight: deque[ray.ObjectRef] = deque()
        while True:
            plan = None
            if len(in_flight) < self.pipeline_depth:
                plan = self._next_plan(wid)
                if not plan.is_empty:
                    admissions = {rid: (self._specs[rid], self._embeds[rid]) for rid in plan.admit}
                    in_flight.append(worker.execute.remote(plan, admissions))
                    continue
            if in_flight:
                try:
                    report, latents = await in_flight.popleft()
                except ray.exceptions.RayActorError as exc:
                    logger.error("worker %s died: %s", wid, exc)
                    in_flight.clear()
                    self._finish_failed(self.core.worker_failed(wid, f"worker {wid} died", time.monotonic()), None)
                    await self._await_restart(worker)
                    continue
                self._apply(report, latents)
                continue
            wake.clear()
            timeout = None if plan.wake_at is None else max(0.0, plan.wake_at - time.monotonic())
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _next_plan(self, wid: str):
        start = time.perf_counter()
        now = time.monotonic()
        plan = self.core.next_plan(wid, now)
        self.metrics.plan_latency.observe(time.perf_counter() - start)
        for rid in plan.admit:
            self.metrics.queue_wait.observe(now - self.core.state(rid).arrival_time)
        if plan.admit:
            self._update_gauges()
        return plan

    async def _await_restart(self, worker) -> None:
        while True:
            try:
                await worker.ready.remote()
                return
            except ray.exceptions.RayActorError:
                await asyncio.sleep(1.0)

    def _apply(self, report: StepReport, latents: dict[str, np.ndarray]) -> None:
        now = time.monotonic()
        self.metrics.step_latency.labels(report.worker_id).observe(report.duration_s)
        if report.batch_size:
            self.metrics.batch_size.observe(report.batch_size)
        for rid in self.core.apply(report, now):
            state = self.core.state(rid)
            future = self._results.get(rid)
            if state.status is RequestStatus.FINISHED:
                self.metrics.requests.labels("finished").inc()
                self.metrics.denoise_latency.observe(now - state.arrival_time)
                if future is not None and not future.done():
                    future.set_result(latents[rid])
            else:
                self.metrics.requests.labels("failed").inc()
                self._fail(rid, RequestFailedError(state.error or "request failed"))
        self._update_gauges()

    def _finish_failed(self, request_ids: list[str], message: str | None) -> None:
        """Fail requests; with a message they are still live in the core and end here."""
        for rid in request_ids:
            if message is not None and not self.core.fail(rid, message, time.monotonic()):
                continue
            self.metrics.requests.labels("failed").inc()
            self._fail(rid, RequestFailedError(self.core.state(rid).error or "request failed"))
        self._wake_all()

    def _fail(self, request_id: str, exc: Exception) -> None:
        future = self._results.get(request_id)
        if future is not None and not future.done():
            future.set_exception(exc)

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(self.core.queue_length)
        self.metrics.running.set(self.core.num_running)
