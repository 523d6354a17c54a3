"""The router: a thin async shell around `RouterCore`, for images and videos under every policy.

It owns the denoiser workers and runs one scheduling task (schedule / execute / update for the
whole pool: the core decides and sends plans, the workers run them, their reports come back)
and one report loop per worker (reports are applied in plan order). With `workers.autoscaling` a
third task sizes the pool once a second (`routing.pool_scaler`): it starts workers, or drains one
(the core hands its requests back to the queue at a step boundary) and ends it once it is empty.

It asks the text encoder for embeddings while a request waits and hands workers only object refs
(with no text encoder, `text_encoder.on_workers`, a request is ready at once and the worker that
admits it encodes its prompts); a denoised image's latents go by reference to the VAE decoder
(or, with no decoder, its worker already decoded it and its PNG comes back), a video's frames to
the job store. A plain class: `build_app` deploys it as a single-replica Serve deployment, so
Serve health-checks and restarts it; the workers it owns share its fate, the job store does not.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray

from stepserve.actors.activation_store import start_activation_stores
from stepserve.actors.metrics import RouterMetrics
from stepserve.actors.replica_metrics import FamilySnapshot
from stepserve.actors.pool import WorkerLauncher, start_lora_stores
from stepserve.actors.worker_options import WorkerPoolSpec, WorkerServices
from stepserve.engine.families import ModelSource, family_class
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.template_edits import template_key
from stepserve.engine.text_encoding import text_item
from stepserve.policies import make_policy, needs_costs
from stepserve.policies.addon_costs import ControlNetPlacement
from stepserve.policies.admission import LoadReport, is_quiet
from stepserve.policies.cost_model import CostModel, ProfiledCostModel, load_profile
from stepserve.policies.instgenie.edit_profile import profiled_costs
from stepserve.policies.patchedserve.mixed_costs import packed
from stepserve.policies.patchedserve.packed_profile import packing_fits
from stepserve.policies.types import RequestFailure, RequestKind, RequestSpec, RequestStatus, WorkerPlan
from stepserve.routing.core import AdmissionRef, CoreConfig, Outcome, QueueFullError, Resume, RouterCore, WorkerSlot
from stepserve.routing.pool_scaler import PoolScaler

logger = logging.getLogger("stepserve.router")

DECODE_ATTEMPTS = 3  # a decoder replica may die under a request; its latents are still here
MAX_RESUMES = 2  # times a video job interrupted by a router restart runs again from its start
LOAD_POLL_TIMEOUT_S = 5.0  # an idle long poll costs one small call this often; shutdown waits for it
SCALE_INTERVAL_S = 1.0  # how often the pool scaler (`workers.autoscaling`) reads the load
STORE_RESTART_WAIT_S = 120.0  # how long a call to a job store that died under it is made again


class RequestFailedError(RuntimeError):
    """A request could not be completed; the message is safe to log, not to show a client."""


class RequestCancelledError(RuntimeError):
    pass


class RequestDiscardedError(RuntimeError):
    """The scheduler gave the request up (`Decision.discard`): it cannot meet its deadline under
    the present load. `message` is the policy's reason, which names no internals: the client may
    see it. `code`: the error code its client gets (HTTP and video jobs alike)."""

    code = "deadline_unattainable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class RouterSpec:
    """What `build_app` hands the router (plain values from `RouterConfig`)."""

    policy: str
    policy_options: dict[str, Any]
    profiles: tuple[str, ...]
    core: CoreConfig
    controlnets: ControlNetPlacement = ControlNetPlacement.INLINE  # how the profile prices ControlNets


def router_costs(spec: RouterSpec, models: Sequence[ModelSource], pool: WorkerPoolSpec) -> CostModel | None:
    """The profiles' cost model (None without profiles). Where workers pack resolutions
    (`workers.pack_resolutions`), a round's plain image groups of a model whose family packs are
    priced as one forward (`policies.patchedserve.PackedForwardCosts`): as the profiles' packed
    forwards measured it where they have them (`packing_fits`), else by the roofline estimate."""
    if not spec.profiles:
        return None
    profile = load_profile(*spec.profiles, controlnets=spec.controlnets)
    costs = _edit_costs(profile, models, pool)
    packing = [m.name for m in models if ModeName.PACKED in family_class(m.family).forward_modes]
    if not (pool.pack_resolutions and packing):
        return costs
    return packed(costs, packing, packing_fits(profile, costs))


def _edit_costs(profile: ProfiledCostModel, models: Sequence[ModelSource], pool: WorkerPoolSpec) -> CostModel:
    """Where edits reuse cached activations (`edit_cache`), the forwards that do are priced from
    the profiles' masked rows for the models whose family has cached edits
    (`policies.instgenie.profiled_costs`); off, every edit computes in full and is priced so,
    whatever its template and mask."""
    if pool.edit_cache is None:
        return profile
    dims = {}
    for model in models:
        family = family_class(model.family)
        if ModeName.TEMPLATE_EDIT in family.forward_modes:
            dims[model.name] = family.dit_dims(model, pool.edit_cache_kind)
            if dims[model.name] is None:
                logger.warning("model %s: its configs cannot be read here; its cached edits are priced in full",
                               model.name)
    return profiled_costs(profile, {name: d for name, d in dims.items() if d is not None})


class Router:
    # Async so the replica reports healthy only once a worker has loaded its models (Serve
    # awaits async constructors); this class is only ever built as a Serve deployment. Every
    # public method is async too: Serve runs sync methods in a thread pool, and the core must
    # only ever be touched from the event loop.
    async def __init__(self, models: Sequence[ModelSource], pool: WorkerPoolSpec, spec: RouterSpec,
                       text_encoder: Any | None, decoder: Any | None, store: Any, name: str = "stepserve",
                       controlnet_service: Any | None = None):
        self.text_encoder, self.decoder, self.store = text_encoder, decoder, store
        # First of all: jobs an earlier router accepted and never finished lost their state with its
        # workers; this router runs them again from their last checkpoints, which the store keeps
        # (from the start without one; queued before anything new). A job interrupted once more
        # after MAX_RESUMES resumes fails instead. Finished jobs are safe in the store. A job the
        # ingress creates while this runs may be taken up here too: its own submission then joins it.
        resumed = await self.store.resume_unfinished.remote(
            MAX_RESUMES, f"the job was interrupted by a router restart {MAX_RESUMES + 1} times; create it again")
        self.id = uuid.uuid4().hex  # this incarnation: the edge's counts of what it received start here
        self.lora_stores = start_lora_stores(pool, models, name)  # by node id; none without LoRAs
        self.lora_bounds = pool.lora_bounds
        # By node id; none unless `edit_cache` is on.
        self.activation_stores = start_activation_stores(pool.edit_cache, name) if pool.edit_cache else {}
        self.edit_cache_kind = pool.edit_cache_kind
        costs = router_costs(spec, models, pool)
        policy = make_policy(spec.policy, spec.policy_options, costs if needs_costs(spec.policy) else None)
        # A world of process groups only when a forward may be split over workers: some model's
        # by sequence parallelism, or any CFG request's under a policy that splits CFG rows. Its
        # size is fixed: when the pool changes, it is built again (`_world_changed`).
        largest = pool.num_workers if pool.scaling is None else pool.scaling.max_workers
        self._uses_world = largest > 1 and (
            any(family_class(m.family).sequence_parallel for m in models) or policy.splits_cfg)
        self._world_dirty = False
        self._rebuilding: asyncio.Task | None = None
        self.pool = pool
        self.launcher = WorkerLauncher(pool, models, name, WorkerServices(self.lora_stores, controlnet_service,
                                                                          self.activation_stores))
        self.workers: dict[str, Any] = {}  # in the pool: loaded, known to the core (draining ones too)
        self._actor_names: dict[str, str] = {}
        # Started, loading (or waiting for a node): its joining task and its actor.
        self._starting: dict[str, tuple[asyncio.Task, Any]] = {}
        self._report_loops: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        # The pool serves as soon as one worker has loaded (every one, when they form a world); the
        # others join as they load.
        started = [self.launcher.start() for _ in range(pool.num_workers)]
        loading = {asyncio.ensure_future(handle.ready.remote()): (index, wid, actor, handle)
                   for index, wid, actor, handle in started}
        done, _ = await asyncio.wait(loading, return_when=asyncio.ALL_COMPLETED if self._uses_world
                                     else asyncio.FIRST_COMPLETED)
        slots = []
        for future in done:
            future.result()  # a worker that cannot load its models fails the deployment
            index, wid, actor, handle = loading.pop(future)
            self.workers[wid], self._actor_names[wid] = handle, actor
            slots.append(WorkerSlot(wid, pool.max_batch_size, index))
        self.core = RouterCore(policy, slots, spec.core, costs)
        self.costs = costs
        self.metrics = RouterMetrics()
        self.metrics.observe_analyzers(getattr(policy, "holdout", {}))  # patchedserve's analyzers; others have none
        if not pool.preload_loras:  # (preloaded LoRAs are on every worker: none ever joins late)
            for lora in pool.loras:
                self.metrics.lora_join_bound.labels(lora.model, lora.name).set(
                    self.lora_bounds.bound(lora.model, lora.name))
        self._waiters: dict[str, asyncio.Future] = {}  # image id -> its PNG bytes
        self._callers: dict[str, int] = {}  # image id -> calls waiting for it (idempotent retries join)
        self._reports: dict[str, deque[ray.ObjectRef]] = {}
        self._report_ready: dict[str, asyncio.Event] = {}
        self._kick = asyncio.Event()
        self._load_changed = asyncio.Event()
        self._published_version = -1
        self._edge_version = self.core.load_version  # the load version the edge's long poll last heard of
        self._edge_quiet = is_quiet(self.core.load())
        # Gate id -> requests of each class received from it (refused ones too): each report
        # tells its gate, so the gate knows exactly what is still on its way here.
        self._received: dict[str, Counter[RequestKind]] = {}
        if self._uses_world:
            await self._join_world(list(self.workers))
        for record, checkpoint in resumed:
            self._resume(record.spec, checkpoint)
        self._loops = [asyncio.create_task(self._schedule_loop(), name="schedule")]
        for wid in self.workers:
            self._start_reports(wid)
        for future, (index, wid, actor, handle) in loading.items():
            self._starting[wid] = (self._spawn(self._join(index, wid, actor, handle, future)), handle)
        self.scaler = None if pool.scaling is None else PoolScaler(pool.scaling)
        if self.scaler is not None:
            self._loops.append(asyncio.create_task(self._scale_loop(), name="scale"))
        self.metrics.pool_target.set(pool.num_workers)
        self._published_pool()

    # -- public methods (called through a DeploymentHandle) ------------------------------

    async def submit(self, spec: RequestSpec, inputs: list | None = None, gate: str | None = None) -> bytes:
        """Queue an image and return its PNG once decoded. Submitting an id that is live with the
        same spec joins it (an idempotent retry); with another spec it is a duplicate. `inputs`:
        [object ref of its control pixels] for a request with ControlNets (in a list, so Ray hands
        over the ref, not its value: a top-level ref argument is resolved). `gate`: the id of the
        admission gate that let it in (`load` tells that gate it arrived)."""
        self._arrived(gate, spec)
        rid = spec.request_id
        waiter = self._waiters.get(rid)
        if waiter is None or self.core.spec(rid) != spec:
            self._submit(spec, inputs[0] if inputs else None)  # a live id with another spec: DuplicateRequestError
            waiter = self._waiters[rid] = asyncio.get_running_loop().create_future()
            self._callers[rid] = 0
        self._callers[rid] += 1
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # This caller went away; once nobody waits, free its slot at the next step.
            self._callers[rid] -= 1
            if self._waiters.get(rid) is waiter and not waiter.done() and not self._callers[rid]:
                self._cancel(rid)
            raise
        finally:
            if waiter.done() and self._waiters.get(rid) is not waiter:
                self._callers.pop(rid, None)

    async def submit_video(self, spec: RequestSpec, gate: str | None = None) -> None:
        """Queue a video job (its record is already in the job store); returns once queued. A job
        this router already runs with the same spec (it took it up when it started) stays as it is."""
        self._arrived(gate, spec)
        if self._live_spec(spec.request_id) != spec:
            self._submit(spec)

    def _live_spec(self, rid: str) -> RequestSpec | None:
        try:
            return self.core.spec(rid)
        except KeyError:
            return None

    def _resume(self, spec: RequestSpec, checkpoint: Any | None) -> None:
        """Run again a job an earlier router accepted (its job record says queued), from its
        checkpoint (the store's `Checkpoint`: steps, state, degrees) if it has one."""
        resume = None if checkpoint is None else Resume(ray.put(checkpoint.state), checkpoint.steps,
                                                        checkpoint.degrees)
        try:
            self._submit(spec, resume=resume)
        except QueueFullError:
            logger.warning("video %s could not be resumed: the video queue is full", spec.request_id)
            error = {"code": "interrupted", "message": "the job was interrupted by a router restart, and the queue "
                                                       "was full when it restarted; create it again"}

            async def record() -> None:
                await self._to_store("set_status", spec.request_id, "failed", error)
            self._spawn(record())

    async def cancel(self, request_id: str) -> bool:
        """Cancel a live request; it leaves its worker at the worker's next step boundary. A video's
        job record says so before this returns."""
        cancelled, recording = self._cancel(request_id)
        if recording is not None:
            await recording
        return cancelled

    def _cancel(self, request_id: str) -> tuple[bool, asyncio.Task | None]:
        """Whether something live was cancelled, and the task recording a video's outcome."""
        try:
            spec = self.core.spec(request_id)
        except KeyError:
            return False, None
        if not self.core.cancel(request_id, time.monotonic()):
            return False, None
        self.metrics.ended(spec, "cancelled")
        self._kick.set()
        return True, self._ended(request_id, spec.kind, RequestCancelledError(f"request {request_id} was cancelled"),
                                 "cancelled")

    async def progress(self, request_id: str) -> dict[str, Any] | None:
        try:
            state = self.core.state(request_id)
        except KeyError:
            return None
        return {"status": state.status.value, "steps_done": state.steps_done, "steps_total": state.steps_total,
                "workers": list(state.workers), "sp_degree": len(state.workers), "pauses": state.pauses,
                "recoveries": state.recoveries, "degrees": list(state.degrees)}

    async def load(self, version: int = -1, gate: str | None = None,
                   timeout_s: float = LOAD_POLL_TIMEOUT_S) -> LoadReport:
        """The router's load for admission at the edge `gate`, as it is when answered; a long
        poll: returns at once when the edge's `version` is out of date, else when it goes out
        of date or after `timeout_s`. A change from one quiet load to another does not
        (`admission.is_quiet`)."""
        if self._edge_version == version:
            self._load_changed.clear()
            try:
                await asyncio.wait_for(self._load_changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return replace(self.core.load(), version=self._edge_version, router_id=self.id,
                       received=dict(self._received.get(gate, {})))

    async def worker_actor_names(self) -> dict[str, str]:
        """Worker id -> its Ray actor name (for operators: `ray list actors`, `ray.get_actor`)."""
        return dict(self._actor_names)

    async def readiness(self) -> dict[str, int]:
        """`workers`: the pool's size as it will be (serving, draining and starting ones)."""
        return {"workers": len(self.workers) + len(self._starting), "live_workers": self.core.live_workers,
                "starting_workers": len(self._starting), "draining_workers": len(self.core.draining_workers),
                "queued": self.core.queue_length(), "running": self.core.count(RequestStatus.RUNNING)}

    async def ingress_metrics(self, replica: str, sequence: int, families: tuple[FamilySnapshot, ...]) -> None:
        """An ingress replica's push of its HTTP metrics (`actors.replica_metrics`): `metrics_text`
        publishes every replica's, summed."""
        self.metrics.ingress.update(replica, sequence, families)

    async def metrics_text(self) -> bytes:
        """The router's metrics and the ingress replicas' summed, in Prometheus's text format."""
        if self.activation_stores:
            nodes = list(self.activation_stores)
            stats = await asyncio.gather(*(self.activation_stores[n].stats.remote() for n in nodes),
                                         return_exceptions=True)
            for node, value in zip(nodes, stats):
                if not isinstance(value, BaseException):  # (a restarting store reports next time)
                    self.metrics.observe_activation_cache(node, value)
        return self.metrics.exposition()

    def check_health(self) -> None:
        """Serve's health hook: a dead loop means the replica must be replaced."""
        for task in [*self._loops, *self._report_loops.values()]:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"router loop {task.get_name()} died: {task.exception()!r}")

    # -- requests --------------------------------------------------------------------------

    def _arrived(self, gate: str | None, spec: RequestSpec) -> None:
        if gate is not None:
            self._received.setdefault(gate, Counter())[spec.kind.lane] += 1

    def _submit(self, spec: RequestSpec, inputs: Any = None, resume: Resume | None = None) -> None:
        # QueueFull/Duplicate go to the caller.
        try:
            self.core.submit(spec, time.monotonic(), self._tail_s(spec), inputs, resume)
        except QueueFullError:
            self.metrics.ended(spec, "refused")  # past the edge: what its gate did not catch
            raise
        if resume is not None:  # its state holds its conditioning: ready now
            self._kick.set()
            self._published()
            return
        if spec.template_id is not None and self.activation_stores:
            # A template spilled to disk comes back to memory while the edit waits (InstGenIE §4.2).
            for store in self.activation_stores.values():
                store.prefetch.remote([template_key(spec, self.edit_cache_kind)])
        loras = bool(spec.loras and self.lora_stores)
        # When a LoRA of it may not join late (exact), it is ready only once the stores hold them:
        # a worker must not stall its batch on a file read. Else they load while it runs.
        waits_for_loras = loras and self.lora_bounds.tightest(spec.model, (u.name for u in spec.loras)) == 0
        if loras and not waits_for_loras:
            self._spawn(self._prepare(spec, text=False, loras=True, then_ready=False))
        if self.text_encoder is not None or waits_for_loras:
            self._spawn(self._prepare(spec, text=self.text_encoder is not None, loras=waits_for_loras,
                                      then_ready=True))
        else:  # its worker encodes its prompts when it admits it
            self.core.mark_ready(spec.request_id, None, time.monotonic())
            self._kick.set()
        self._published()

    def _tail_s(self, spec: RequestSpec) -> float:
        """What follows the last step, as the profile predicts it (decode, encoding)."""
        if self.costs is None:
            return 0.0
        try:
            return self.costs.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames)
        except LookupError:
            return 0.0

    async def _prepare(self, spec: RequestSpec, text: bool, loras: bool, then_ready: bool) -> None:
        """Ask for its embeddings (`text`) and have every LoRA store hold its LoRAs (`loras`; a
        worker on any node may admit it); once that is done, it is ready if `then_ready`. The
        embeddings are never fetched here: the worker that admits the request reads them (and a
        failed encoding fails the request there, on its own)."""
        jobs = ([self._embeddings(spec)] if text else []) + ([self._prefetch_loras(spec, then_ready)] if loras else [])
        try:
            done = await asyncio.gather(*jobs)
        except _Unprepared as exc:
            self._fail(spec.request_id, str(exc))
            return
        if then_ready:
            self.core.mark_ready(spec.request_id, done[0] if text else None, time.monotonic())
            self._kick.set()

    async def _embeddings(self, spec: RequestSpec) -> Any:
        """The ref of its embeddings, once they exist."""
        try:
            response = self.text_encoder.encode.remote(*text_item(spec))
            ref = await response._to_object_ref()
            await ref._ready()
        except Exception:
            logger.exception("text encoding of %s could not be requested", spec.request_id)
            raise _Unprepared("text encoder unavailable") from None
        return ref

    async def _prefetch_loras(self, spec: RequestSpec, waited_for: bool) -> None:
        names = [use.name for use in spec.loras]
        started = time.perf_counter()
        try:
            await asyncio.gather(*(store.prefetch.remote(spec.model, names) for store in self.lora_stores.values()))
            if waited_for:
                self.metrics.lora_wait.labels("queue").observe(time.perf_counter() - started)
        except Exception as exc:
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
            raise _Unprepared(f"LoRA unavailable: {type(cause).__name__}: {cause}") from None

    # -- the scheduling task -------------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        timeout: float | None = None
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            started = time.perf_counter()
            now = time.monotonic()
            decision = self.core.schedule(now, self._send, self._interrupt)
            self.metrics.plan_latency.observe(time.perf_counter() - started)
            timeout = None if decision.wake_at is None else max(0.0, decision.wake_at - time.monotonic())
            for failure in decision.discard:
                self._discarded(failure)
            if decision.plans or decision.discard:
                self._published()

    def _send(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...]) -> list[ray.ObjectRef]:
        """Dispatch one plan; returns refs to what it will return (owned here, so they outlive
        the worker). Ray runs one caller's calls to an actor in order."""
        for rid in plan.admit:
            state = self.core.state(rid)
            if state.admit_time is None:
                self.metrics.queue_wait.observe(time.monotonic() - state.arrival_time)
        for group in plan.groups:  # counted at the group's first rank
            if group.ranks and self.core.rank(plan.worker_id) == group.ranks[0]:
                self.metrics.split_steps.labels(group.split.value).inc(plan.steps)
        returns = self.workers[plan.worker_id].execute.options(num_returns=1 + len(plan.outputs)).remote(plan, admissions)
        if not plan.outputs:
            returns = [returns]
        self._reports[plan.worker_id].append(returns[0])
        self._report_ready[plan.worker_id].set()
        return list(returns[1:])

    def _interrupt(self, worker_id: str, plan_id: int) -> None:
        """Ask a worker to end a plan after its current step; its report says how many ran. Not
        awaited: a dead worker's report loop finds out."""
        self.workers[worker_id].interrupt.remote(plan_id)

    # -- reports ---------------------------------------------------------------------------

    async def _report_loop(self, wid: str) -> None:
        worker, queue, ready = self.workers[wid], self._reports[wid], self._report_ready[wid]
        while True:
            if not queue:
                ready.clear()
                await ready.wait()
                continue
            try:
                report = await queue[0]
            except Exception as exc:
                if wid not in self.workers:
                    return  # drained and removed from the pool
                if not isinstance(exc, ray.exceptions.RayActorError):
                    # The worker raised out of a plan (a bug: it isolates request failures):
                    # its state is suspect, so it restarts clean and what it held resumes.
                    logger.exception("worker %s failed a plan; restarting it", wid)
                    ray.kill(worker, no_restart=False)
                logger.error("worker %s died: %s", wid, exc)
                queue.clear()
                self.metrics.worker_restarts.inc()
                self._handle(self.core.worker_lost(wid, time.monotonic()))
                if self._uses_world:
                    self.core.set_sp_available(False)
                self._kick.set()
                incarnation = await self._await_restart(worker)
                self.core.worker_back(wid, incarnation)
                self._world_changed()
                self._kick.set()
                continue
            queue.popleft()
            now = time.monotonic()
            self.metrics.observe_plan(wid, report.duration_s, self.core.steps_ran(report))
            if report.waited_s is not None:
                self.metrics.worker_wait.labels(wid).observe(report.waited_s)
            if report.batch_size:
                self.metrics.batch_size.observe(report.batch_size)
            if report.lora_wait_s:
                self.metrics.lora_wait.labels("batch").observe(report.lora_wait_s * max(1, report.batch_size))
            self.metrics.observe_edit_blocks(report.edit_blocks)
            self.metrics.observe_load_control(wid, report.load_control)
            self._handle(self.core.apply(report, now))
            self._kick.set()

    def _handle(self, outcome: Outcome) -> None:
        for rid, handle in outcome.denoised:
            self.metrics.denoise_latency.observe(time.monotonic() - self.core.state(rid).arrival_time)
            spec = self.core.spec(rid)
            self._spawn(self._store_video(spec, handle) if spec.is_video else self._decode_image(spec, handle))
        for rid in outcome.failed:
            state = self.core.state(rid)
            self.metrics.ended(self.core.spec(rid), "failed")
            logger.warning("request %s failed: %s", rid, state.error)
            self._ended(rid, state.kind, RequestFailedError(state.error or "request failed"), "failed")
        for rid in outcome.recovered:
            self.metrics.recoveries.inc()
            logger.info("request %s lost its state to a worker fault; it resumes from its last checkpoint", rid)
        for rid, resume in outcome.checkpointed:
            if self.core.spec(rid).is_video:  # the store keeps it for a router restart
                self._spawn(self._store_checkpoint(rid, resume))
        if outcome.denoised or outcome.failed or outcome.recovered:
            self._published()

    async def _decode_image(self, spec: RequestSpec, output: ray.ObjectRef) -> None:
        """`output` is the image's latents, which the decoder turns into its PNG, or (no decoder:
        `vae_decoder.on_workers`) the PNG its worker already decoded."""
        rid = spec.request_id
        png = await (self._fetch_png(rid, output) if self.decoder is None else self._decode_png(spec, output))
        if png is None:
            self._fail(rid, "decoding failed")
            return
        now = time.monotonic()
        if self.core.complete(rid, now):
            self.metrics.finished(spec, self.core.state(rid), now)
            waiter = self._waiters.pop(rid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(png)
            self.core.forget(rid)
        self._published()
        self._kick.set()

    async def _decode_png(self, spec: RequestSpec, latents: ray.ObjectRef) -> bytes | None:
        for attempt in range(1, DECODE_ATTEMPTS + 1):
            try:
                return await self.decoder.decode_png.remote(spec.model, latents)
            except Exception:
                logger.exception("decoding %s failed (attempt %d of %d)", spec.request_id, attempt, DECODE_ATTEMPTS)
        return None

    @staticmethod
    async def _fetch_png(rid: str, png: ray.ObjectRef) -> bytes | None:
        try:
            png = await png
            # Decoded in chunks (`vae_decoder.chunks`): the plan gave the ref of the worker's decode call.
            return await png if isinstance(png, ray.ObjectRef) else png
        except Exception:  # its worker died before the PNG could be fetched
            logger.exception("fetching the decoded image of %s failed", rid)
            return None

    async def _store_video(self, spec: RequestSpec, frames: ray.ObjectRef) -> None:
        rid = spec.request_id
        state = self.core.state(rid)
        try:
            stored = await self._to_store("complete", rid, frames, state.pauses, state.degrees)
        except Exception:
            logger.exception("storing video %s failed", rid)
            stored = False
        now = time.monotonic()
        if stored and self.core.complete(rid, now):
            self.metrics.finished(spec, self.core.state(rid), now)
        elif not stored:
            self._fail(rid, "the finished video could not be stored")
        if self.core.state(rid).status.is_terminal:
            self.core.forget(rid)
        self._published()
        self._kick.set()

    async def _to_store(self, method: str, *args: Any) -> Any:
        """A job-store call, made again while the store restarts (it reads its journal back, so
        what was written before is there; each of these calls may be made twice)."""
        deadline = time.monotonic() + STORE_RESTART_WAIT_S
        while True:
            try:
                return await getattr(self.store, method).remote(*args)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if time.monotonic() >= deadline:
                    raise
                logger.warning("the job store died under %s; calling it again", method)
                await asyncio.sleep(1.0)

    async def _store_checkpoint(self, rid: str, resume: Resume) -> None:
        try:  # (the store resolves the state's ref: the bytes go worker to store)
            await self._to_store("checkpoint", rid, resume.steps, resume.state, resume.degrees)
        except Exception:
            logger.exception("storing a checkpoint of video %s failed; a restart resumes it from an older one", rid)

    def _fail(self, rid: str, message: str) -> None:
        try:
            spec = self.core.spec(rid)
        except KeyError:
            return
        if self.core.fail(rid, message, time.monotonic()):
            self.metrics.ended(spec, "failed")
            self._ended(rid, spec.kind, RequestFailedError(message), "failed")
            self._kick.set()

    def _discarded(self, failure: RequestFailure) -> None:
        """A request the policy gave up, already FAILED in the core: its callers get the reason."""
        rid = failure.request_id
        self.metrics.ended(self.core.spec(rid), "failed")
        logger.info("request %s was given up by the scheduler: %s", rid, failure.message)
        self._ended(rid, self.core.spec(rid).kind, RequestDiscardedError(failure.message), "failed")

    def _ended(self, rid: str, kind: RequestKind, exc: Exception, status: str) -> asyncio.Task | None:
        """Tell whoever waits for a request that ended early. For a video, returns the running
        task that records its outcome in the job store (await it to know it is recorded)."""
        self.core.forget(rid)
        if kind is RequestKind.T2V:
            if isinstance(exc, RequestDiscardedError):
                error = {"code": exc.code, "message": exc.message}
            else:
                failed = {"code": "generation_failed", "message": "video generation failed"}
                error = None if status == "cancelled" else failed
            return self._spawn(self._set_job_status(rid, status, error))
        waiter = self._waiters.pop(rid, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        return None

    async def _set_job_status(self, rid: str, status: str, error: dict[str, str] | None) -> None:
        try:
            await self._to_store("set_status", rid, status, error)
        except Exception:
            logger.exception("could not record video %s as %s in the job store", rid, status)

    # -- the pool grows and shrinks ---------------------------------------------------------

    def _start_reports(self, wid: str) -> None:
        self._reports[wid] = deque()
        self._report_ready[wid] = asyncio.Event()
        self._report_loops[wid] = asyncio.create_task(self._report_loop(wid), name=f"reports-{wid}")

    async def _join(self, index: int, wid: str, actor: str, handle: Any, loaded: Any) -> None:
        """A started worker joins the pool once it has loaded its models. One that cannot is
        killed (the scaler starts another while the load still asks for it)."""
        try:
            incarnation = await loaded
        except Exception:
            logger.exception("worker %s could not start; it is given up", wid)
            ray.kill(handle, no_restart=True)
            return
        finally:
            self._starting.pop(wid, None)
        self.workers[wid], self._actor_names[wid] = handle, actor
        self.core.add_worker(WorkerSlot(wid, self.pool.max_batch_size, index), incarnation)
        self._start_reports(wid)
        self._world_changed()
        logger.info("worker %s joined the pool", wid)
        self._published_pool()
        self._kick.set()

    async def _scale_loop(self) -> None:
        """Once a second: the scaler's target from the load signal; start workers to reach it, or
        drain one (a starting one is stopped first: it serves nobody yet). A drained worker is
        removed and its actor ended, which frees its resources for Ray's autoscaler to reclaim."""
        target = None
        while True:
            await asyncio.sleep(SCALE_INTERVAL_S)
            rebuilding = self._rebuilding is not None and not self._rebuilding.done()
            for wid in [w for w in self.core.draining_workers if self.core.drained(w) and not rebuilding]:
                self._remove(wid)  # (not while the world is rebuilt with it in)
            size = len(self.workers) - len(self.core.draining_workers) + len(self._starting)
            wanted = self.scaler.target(self.core.pool_load(time.monotonic()), size, time.monotonic())
            for _ in range(wanted - size):
                index, wid, actor, handle = self.launcher.start()
                joining = self._spawn(self._join(index, wid, actor, handle, handle.ready.remote()))
                self._starting[wid] = (joining, handle)
                self.metrics.pool_changes.labels("grow").inc()
                logger.info("pool: %d -> %d workers; starting %s", size, wanted, wid)
            if wanted < size:
                self._shrink()
            if wanted != target:
                target = wanted
                self.metrics.pool_target.set(wanted)
                self._request_nodes(wanted)
            self._published_pool()

    def _shrink(self) -> None:
        """One worker fewer: the newest starting one, else the serving one holding least."""
        if self._starting:
            wid = next(reversed(self._starting))
            task, handle = self._starting.pop(wid)
            task.cancel()
            ray.kill(handle, no_restart=True)
        else:
            serving = [w for w in self.workers if w not in self.core.draining_workers]
            by_load = sorted(serving, key=lambda w: (len(self.core.worker_record(w).residents), -self.core.rank(w)))
            wid = next((w for w in by_load if self.core.drain(w)), None)
            if wid is None:
                return  # every candidate holds a group over several workers: next time
            self._kick.set()  # its export plan goes out in the next round
        self.metrics.pool_changes.labels("shrink").inc()
        logger.info("pool: draining %s", wid)

    def _remove(self, wid: str) -> None:
        self.core.remove_worker(wid)
        handle = self.workers.pop(wid)
        self._actor_names.pop(wid, None)
        self._report_loops.pop(wid).cancel()
        self._reports.pop(wid, None)
        self._report_ready.pop(wid, None)
        # What it exported lives on in its node's object store (this router owns it) until the
        # requests resume elsewhere; only the actor goes.
        ray.kill(handle, no_restart=True)
        self._world_changed()
        logger.info("worker %s left the pool", wid)

    def _request_nodes(self, workers: int) -> None:
        """Tell Ray's autoscaler the pool's whole demand (it replaces the last request): it brings
        up nodes for workers still waiting, and may reclaim those no request covers."""
        from ray.autoscaler.sdk import request_resources

        try:
            request_resources(bundles=[self.pool.bundle] * workers)
        except Exception:  # no autoscaler (a fixed cluster): the pending actors are the only ask
            logger.debug("request_resources failed", exc_info=True)

    def _published_pool(self) -> None:
        draining = len(self.core.draining_workers)
        self.metrics.pool_workers.labels("serving").set(len(self.workers) - draining)
        self.metrics.pool_workers.labels("starting").set(len(self._starting))
        self.metrics.pool_workers.labels("draining").set(draining)

    # -- faults and the SP world -----------------------------------------------------------

    async def _await_restart(self, worker: Any) -> str:
        while True:
            try:
                return await worker.ready.remote()
            except ray.exceptions.RayActorError:
                await asyncio.sleep(1.0)

    async def _join_world(self, workers: list[str]) -> None:
        """`workers` join one world, ranked in that order; on one node its store is a file, not a
        listening port."""
        handles = [self.workers[wid] for wid in workers]
        nodes = await asyncio.gather(*(w.node_id.remote() for w in handles))
        init_method = await handles[0].sp_rendezvous.remote(len(set(nodes)) == 1)
        await asyncio.gather(*(w.join_sp_world.remote(init_method, rank, len(handles))
                               for rank, w in enumerate(handles)))

    def _world_changed(self) -> None:
        """A worker restarted, joined or left: no SP group forms until every worker is in a new
        world (a world's size and members are fixed)."""
        if not self._uses_world:
            return
        self.core.set_sp_available(False)
        self._world_dirty = True
        if self._rebuilding is None or self._rebuilding.done():
            self._rebuilding = self._spawn(self._rebuild_world())

    async def _rebuild_world(self) -> None:
        """Once no SP step is in flight and every worker is live, all leave the old world and join
        a new one, ranked in pool order (the core's ranks follow); again while the pool changed
        meanwhile."""
        while self._world_dirty:
            self._world_dirty = False
            while self.core.sp_in_use or self.core.live_workers < len(self.workers):
                await asyncio.sleep(0.2)
            workers = list(self.workers)
            await asyncio.gather(*(self.workers[w].leave_sp_world.remote() for w in workers))
            self.core.rerank(workers)
            await self._join_world(workers)
        self.core.set_sp_available(True)
        self._kick.set()

    # -- plumbing --------------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _published(self) -> None:
        """Publish the load when it changed: set the gauges, and wake the edge's long poll unless
        the load was quiet and still is. Most rounds change nothing the load says (a step is not
        news to the edge)."""
        if self.core.load_version == self._published_version:
            return
        self._published_version = self.core.load_version
        report = self.core.load()
        quiet = is_quiet(report)
        if not (quiet and self._edge_quiet):
            self._edge_version, self._edge_quiet = report.version, quiet
            self._load_changed.set()
        self.metrics.queue_length.labels("image").set(self.core.queue_length(RequestKind.T2I))
        self.metrics.queue_length.labels("video").set(self.core.queue_length(RequestKind.T2V))
        self.metrics.queued_steps.labels("image").set(self.core.queued_steps(RequestKind.T2I))
        self.metrics.queued_steps.labels("video").set(self.core.queued_steps(RequestKind.T2V))
        self.metrics.running.set(self.core.count(RequestStatus.RUNNING))
        self.metrics.decoding.set(self.core.count(RequestStatus.DECODING))


class _Unprepared(Exception):
    """A request cannot become ready (its text encoder or LoRA store failed): the message says why."""
