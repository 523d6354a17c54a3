"""The co-serving router: images and videos on one worker pool, scheduled by GenServe.

An async shell around `CoServeCore`, as `Router` is around `RouterCore`, with the same public
image methods (so the ingress talks to either) plus the video job methods. One decision task
runs the core whenever something changed and starts each assignment it hands out as its own
task; an assignment's task calls the workers, reports back to the core, and asks for the next
decision. Latents and video states go worker to worker as Ray object refs; the router holds
only the refs of paused videos and the frames of finished ones until they are fetched.

Videos with sequence parallelism need the workers in one `torch.distributed` world: the router
sets it up at start (rank = worker index) and names SP groups by those ranks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from ..engine.families import ModelSource
from ..policies.cost_model import load_profile
from ..policies.genserve import GenServeConfig, ObservedOverheadCosts, ProfiledStepCosts
from ..policies.types import RequestSpec, VideoSpec, WorkerPlan
from .coserve_core import CoServeCore, ImageStep, JobStatus, VideoDecode, VideoPause, VideoStep
from .metrics import RouterMetrics
from .pool import WorkerPoolSpec, start_workers
from .step_overhead import StepOverhead
from .router import RequestFailedError, encode_texts

logger = logging.getLogger("stepserve.coserve")

FINISHED_VIDEOS_KEPT = 64  # decoded videos held for download, oldest dropped first


class CoServeRouter:
    async def __init__(self, models: Sequence[ModelSource], pool: WorkerPoolSpec, config: GenServeConfig,
                       profiles: Sequence[str], slo_s: Mapping[str, float | None], max_queue_len: int,
                       text_encoder: Any, name: str = "stepserve"):
        self.text_encoder = text_encoder
        self.config = config
        self.slo_s = dict(slo_s)
        self.workers = start_workers(pool, models, name)
        self.ranks = {wid: rank for rank, wid in enumerate(self.workers)}
        self.cost = load_profile(*profiles)
        self.step_costs = ProfiledStepCosts(self.cost)
        self.overhead = StepOverhead()
        self.core = CoServeCore(tuple(self.workers), self.config, self.step_costs, max_queue_len)
        self.metrics = RouterMetrics()
        self._specs: dict[str, RequestSpec | VideoSpec] = {}
        self._embeds: dict[str, ray.ObjectRef] = {}
        self._results: dict[str, asyncio.Future] = {}  # images: their latents
        self._paused: dict[str, ray.ObjectRef] = {}  # videos: state in host memory
        self._groups: dict[str, tuple[str, ...]] = {}  # videos: the group holding their state
        self._history: dict[str, list[tuple[str, ...]]] = {}  # videos: every group they stepped on, in order
        self._frames: OrderedDict[str, np.ndarray] = OrderedDict()
        self._created: dict[str, float] = {}  # videos: wall-clock creation time
        self._completed: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._kick = asyncio.Event()
        self._loop: asyncio.Task | None = None
        await self.ready()
        if len(self.workers) > 1:
            await self._join_world()

    # -- public methods (called through a DeploymentHandle) ------------------------------

    async def ready(self) -> bool:
        await asyncio.gather(*(w.ready.remote() for w in self.workers.values()))
        return True

    async def submit(self, spec: RequestSpec) -> np.ndarray:
        """Queue an image and return its final latents when denoising ends (as `Router.submit`)."""
        self._start()
        rid = spec.request_id
        tail = self.cost.decode_seconds(spec.model, spec.height, spec.width)
        self.core.submit_image(spec, time.monotonic(), self._deadline(spec.model), tail)
        self._specs[rid] = spec
        self._results[rid] = asyncio.get_running_loop().create_future()
        self._spawn(self._encode(spec))
        try:
            return await self._results[rid]
        except asyncio.CancelledError:  # the caller went away; the image finishes and is discarded
            raise
        finally:
            self._results.pop(rid, None)

    async def submit_video(self, spec: VideoSpec) -> None:
        """Queue a video job; poll `video_status`, fetch `video_frames` when completed."""
        self._start()
        tail = self.cost.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames)
        self.core.submit_video(spec, time.monotonic(), self._deadline(spec.model), tail)
        self._specs[spec.request_id] = spec
        self._created[spec.request_id] = time.time()
        self._spawn(self._encode(spec))

    def video_status(self, job_id: str) -> dict[str, Any] | None:
        try:
            state = self.core.state(job_id)
        except KeyError:
            return None
        if state.kind != "video":
            return None
        status = {JobStatus.QUEUED: "queued", JobStatus.FINISHED: "completed", JobStatus.FAILED: "failed"}.get(
            state.status, "in_progress")
        return {
            "status": status, "steps_done": state.steps_done, "steps_total": state.steps_total,
            "error": state.error, "created_at": self._created.get(job_id), "completed_at": self._completed.get(job_id),
            "paused": state.status is JobStatus.PAUSED, "pauses": state.pauses,
            "sp_degree": len(state.workers), "degrees": list(state.degrees),
            "groups": [list(g) for g in self._history.get(job_id, ())],
        }

    def video_frames(self, job_id: str) -> np.ndarray | None:
        return self._frames.get(job_id)

    def progress(self, request_id: str) -> dict[str, Any] | None:
        try:
            state = self.core.state(request_id)
        except KeyError:
            return None
        return {"status": state.status.value, "steps_done": state.steps_done, "steps_total": state.steps_total}

    def cancel(self, request_id: str) -> bool:
        """Not supported here yet: a cancelled image still runs to its end (its caller has
        stopped waiting). False says nothing was cancelled."""
        return False

    def stats(self) -> dict[str, int]:
        return {"queue_length": self.core.queue_length, "workers": len(self.workers),
                "decisions": self.core.decisions}

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def check_health(self) -> None:
        if self._loop is not None and self._loop.done() and not self._loop.cancelled() and self._loop.exception():
            raise RuntimeError(f"decision loop died: {self._loop.exception()!r}")

    # -- setup --------------------------------------------------------------------------------

    async def _join_world(self) -> None:
        first = next(iter(self.workers.values()))
        addr, port = await first.sp_rendezvous_address.remote()
        await asyncio.gather(*(w.join_sp_world.remote(addr, port, self.ranks[wid], len(self.workers))
                               for wid, w in self.workers.items()))

    def _start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._decide_loop(), name="coserve-decide")

    def _deadline(self, model: str) -> float:
        slo = self.slo_s.get(model)
        return math.inf if slo is None else time.monotonic() + slo

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _encode(self, spec: RequestSpec | VideoSpec) -> None:
        rid = spec.request_id
        try:
            ref = await encode_texts(self.text_encoder, spec)
        except Exception as exc:
            self._failed(rid, f"text encoding failed: {exc}")
            return
        self._embeds[rid] = ref
        self.core.mark_ready(rid)
        self._kick.set()

    # -- the decision loop -------------------------------------------------------------------

    async def _decide_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            started = time.perf_counter()
            assignments = self.core.schedule(time.monotonic())
            self.metrics.plan_latency.observe(time.perf_counter() - started)
            for a in assignments:
                self._spawn(self._execute(a))
            self.metrics.queue_length.set(self.core.queue_length)

    async def _execute(self, assignment) -> None:
        try:
            if isinstance(assignment, ImageStep):
                await self._image_step(assignment)
            elif isinstance(assignment, VideoStep):
                await self._video_step(assignment)
            elif isinstance(assignment, VideoPause):
                await self._video_pause(assignment)
            elif isinstance(assignment, VideoDecode):
                await self._video_decode(assignment)
        except Exception as exc:  # a failed step fails its requests, never the router
            logger.exception("assignment %r failed", assignment)
            self._assignment_failed(assignment, f"{type(exc).__name__}: {exc}")
        finally:
            self._kick.set()

    async def _image_step(self, step: ImageStep) -> None:
        worker = self.workers[step.worker_id]
        for rid, source in step.moves:  # Ray keeps one caller's calls to an actor in order
            worker.image_import.remote(self.workers[source].image_export.remote(rid))
        plan = WorkerPlan(step.worker_id, admit=step.admit, groups=(step.request_ids,))
        admissions = {rid: (self._specs[rid], self._embeds[rid]) for rid in step.admit}
        started = time.monotonic()
        report, latents = await worker.execute.remote(plan, admissions)
        if not step.admit and not step.moves:  # a plain step: what the profile predicts
            spec = self._specs[step.request_ids[0]]
            rows = sum(2 if self._specs[rid].uses_cfg else 1 for rid in step.request_ids)
            predicted = self.step_costs.image_step_seconds(spec.model, spec.height, spec.width, rows)
            self._calibrate("image", time.monotonic() - started, predicted)
        self.metrics.step_latency.labels(step.worker_id).observe(report.duration_s)
        self.metrics.batch_size.observe(report.batch_size)
        for rid, message in report.failed:
            self._failed(rid, message)
        stepped = {p.request_id for p in report.progress} | set(report.finished)
        for rid in step.request_ids:
            if rid not in stepped:  # e.g. its move failed: the worker never held it
                self._failed(rid, f"request {rid} was not resident on {step.worker_id} for its step")
        now = time.monotonic()
        for rid in self.core.image_step_done(step.worker_id, now):
            self.metrics.requests.labels("finished").inc()
            self._forget(rid)
            future = self._results.get(rid)
            if future is not None and not future.done():
                future.set_result(latents[rid])

    async def _video_step(self, step: VideoStep) -> None:
        job, spec = step.job_id, self._specs[step.job_id]
        members = [self.workers[w] for w in step.workers]
        if step.source == "new":
            for w in members:
                w.video_start.remote(spec, self._embeds[job])
        elif step.source in ("host", "move"):
            state = self._paused.pop(job) if step.source == "host" else self._export(job, step.from_workers)
            for w in members:
                w.video_import.remote(state)
        self._groups[job] = step.workers
        history = self._history.setdefault(job, [])
        if step.source != "resident" or not history:
            history.append(step.workers)
        ranks = tuple(self.ranks[w] for w in step.workers)
        started = time.monotonic()
        progress = await asyncio.gather(*(w.video_step.remote(job, ranks) for w in members))
        if step.source == "resident":
            predicted = self.step_costs.video_step_seconds(spec.model, spec.height, spec.width, spec.num_frames,
                                                           len(step.workers))
            self._calibrate("video", time.monotonic() - started, predicted)
        self.metrics.step_latency.labels(step.workers[0]).observe(max(p.duration_s for p in progress))
        self.core.video_step_done(job, time.monotonic())

    def _calibrate(self, kind: str, observed_s: float, predicted_s: float) -> None:
        if self.overhead.observe(kind, observed_s, predicted_s):
            image_extra, video_extra = self.overhead.apply()
            self.core.set_costs(ObservedOverheadCosts(self.step_costs, image_extra, video_extra))
            self.metrics.step_overhead.labels("image").set(image_extra)
            self.metrics.step_overhead.labels("video").set(video_extra)

    def _export(self, job: str, group: tuple[str, ...]) -> ray.ObjectRef:
        """The video's state leaves `group` for host memory: one member exports, the rest drop."""
        state = self.workers[group[0]].video_export.remote(job)
        for w in group[1:]:
            self.workers[w].video_drop.remote(job)
        return state

    async def _video_pause(self, pause: VideoPause) -> None:
        self._paused[pause.job_id] = self._export(pause.job_id, pause.workers)
        self._groups.pop(pause.job_id, None)
        await self._paused[pause.job_id]  # surfaces a failed export here, not at resume

    async def _video_decode(self, decode: VideoDecode) -> None:
        job = decode.job_id
        for w in self._groups.pop(job, (decode.worker_id,)):
            if w != decode.worker_id:
                self.workers[w].video_drop.remote(job)
        frames = await self.workers[decode.worker_id].video_decode.remote(job)
        self._frames[job] = frames
        while len(self._frames) > FINISHED_VIDEOS_KEPT:  # the oldest download is gone: so is its job
            old, _ = self._frames.popitem(last=False)
            self.core.forget(old)
            self._history.pop(old, None)
            self._created.pop(old, None)
            self._completed.pop(old, None)
        self._completed[job] = time.time()
        self.core.video_decoded(job, decode.worker_id, time.monotonic())
        self.metrics.requests.labels("finished").inc()
        self._forget(job, keep_state=True)

    # -- failures ----------------------------------------------------------------------------

    def _assignment_failed(self, assignment, message: str) -> None:
        if isinstance(assignment, ImageStep):
            ids, workers = assignment.request_ids, (assignment.worker_id,)
        elif isinstance(assignment, VideoStep):
            ids, workers = (assignment.job_id,), assignment.workers
        elif isinstance(assignment, VideoDecode):
            ids, workers = (assignment.job_id,), (assignment.worker_id,)
        else:
            ids, workers = (assignment.job_id,), ()
        for rid in ids:
            self._failed(rid, message)
        for w in workers:
            self.core.worker_done(w)
            if isinstance(assignment, VideoStep):  # whatever copies of its state are left
                self.workers[w].video_drop.remote(assignment.job_id)

    def _failed(self, rid: str, message: str) -> None:
        if self.core.fail(rid, message, time.monotonic()):
            self.metrics.requests.labels("failed").inc()
        future = self._results.get(rid)
        if future is not None and not future.done():
            future.set_exception(RequestFailedError(message))
        self._forget(rid, keep_state=True)
        self._kick.set()

    def _forget(self, rid: str, keep_state: bool = False) -> None:
        """Drop what the router held for a finished request; videos keep their core state so
        their status stays readable."""
        self._specs.pop(rid, None)
        self._embeds.pop(rid, None)
        self._paused.pop(rid, None)
        if not keep_state and self.core.state(rid).status.is_terminal:
            self.core.forget(rid)

