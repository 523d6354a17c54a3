"""The discrete-event simulator: the live `RouterCore` and policies, with time from a cost model.

What it models, in the live system's order (actors/router.py, deployments/):

1. A request (image or video) arrives at its workload offset; `submit_overhead_share` of the
   cost model's fixed per-request overhead (HTTP, proxy, ingress hops) passes before
   `RouterCore.submit`, with the SLO left of its own (the workload's SLO runs from the send).
2. Its texts (prompt, plus the negative prompt under CFG) go to the text encoder: a queue per
   replica, `@serve.batch` batching, an embeddings cache. When they arrive the core is told
   (`mark_ready`) and a round is decided. With no text encoder (`text_encoder.replicas` 0,
   `text_encoder.on_workers`) it is ready at once, and the plan that admits it encodes them.
3. Rounds: whenever something changes (ready requests, a report, a finished decode), one
   `RouterCore.schedule` at that instant, which sends plans to workers as the live router does
   (up to `pipeline_depth` queued per worker). A request the policy's decision gives up (its
   `discard`: PatchedServe's requests that cannot meet their deadlines) fails then, in the core.
4. A worker runs its plans in order (`SimWorker`, the StepRunner's twin); each takes the cost
   model's `round_seconds` of the groups that ran (plus the VAE decode of a video it finishes,
   and of an image when `decoders` is 0; and first, with no text encoder, the prompts of the
   fresh starts it admits, through an embeddings cache per worker). An edit of a template
   (`ScheduledEdit`) computes its masked share and reuses cached activations for the rest,
   which the cost model prices when it is a `policies.instgenie.MaskAwareCosts`; any other
   edit runs a full forward. A plan with a sequence-parallel step starts when
   every member of the group has reached it, as the collective makes the live workers wait; a
   plan that resumes a request starts when the state it resumes from exists. A plan the core
   interrupts ends after the step it is running (or after its first, if it has not started).
   Reports go to `RouterCore.apply`.
5. A denoised image goes to the VAE decoder (a FIFO per replica; with no decoder its worker
   already decoded it), a denoised video is stored; then the core is told it is complete, and
   the rest of the request overhead passes before the response.

With `host_cpus` set, every timed piece of work (request overhead, text encoding, worker plans,
decoding) is single-threaded CPU work on one `SharedHost` of that many cores, so they slow each
other down as they do when a whole app shares a CPU box; so is the router's CPU for each step a
worker reports (the profile's router_cpu, off every request's path: it overlaps the worker's
next step), over a background of what the idle app burns (host_idle). Without it, each has a
device of its own and takes exactly its profiled time, and the router's work is free.

Decisions and state moves are instantaneous in simulated time: the router's decision time is
measured (wall clock) but on no request's path, nor is the plan/report RPC beyond the cost model's
per-round overhead, nor pausing or moving a video (GenServe measures both under 1 ms against
steps of hundreds, Table 7). Worker faults are not modelled. With `scaling` the pool grows and
shrinks as the live router's does (`routing.pool_scaler`, once a simulated second): a started
worker serves `worker_start_s` later, a drained one leaves once the core has moved what it held.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from stepserve.load_tests.edit_workload import ScheduledEdit
from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.records import RequestRecord, record_of
from stepserve.load_tests.sim.events import EventQueue
from stepserve.load_tests.sim.host import SharedHost
from stepserve.load_tests.sim.services import DecoderService, TextCache, TextEncoderService, TextEncoderSpec
from stepserve.load_tests.sim.synerdiff import SynerDiffSim, WorkerSequencer
from stepserve.load_tests.sim.worker import SimAdmission, SimWorker
from stepserve.load_tests.workload import ScheduledRequest
from stepserve.policies import make_policy, needs_costs, options_for_workers
from stepserve.policies.cost_model import BatchShape, ProfiledCostModel
from stepserve.policies.patchedserve.mixed_costs import packed
from stepserve.policies.patchedserve.packed_profile import packing_fits
from stepserve.policies.types import (ControlNetUse, LoraBatching, LoraUse, RequestKind, RequestSpec, RequestStatus,
                                      WorkerPlan)
from stepserve.routing.core import AdmissionRef, CoreConfig, QueueFullError, RouterCore, WorkerSlot
from stepserve.routing.pool_scaler import PoolScaler, ScalingSpec

SCALE_INTERVAL_S = 1.0  # as the live router's (`actors.router.SCALE_INTERVAL_S`)


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    max_batch_size: int = 8  # per worker (configs/local-tiny.yaml; SynerDiff's BS=8)
    policy: str = "continuous"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    pipeline_depth: int = 2  # RouterConfig.pipeline_depth
    pipeline_lead_s: float = 0.05  # RouterConfig.pipeline_lead_s
    max_plan_s: float = 0.3  # RouterConfig.max_plan_s
    max_queued_images: int = 256  # RouterConfig: beyond it a request is rejected (429)
    max_queued_videos: int = 64
    max_image_queue_wait_s: float | None = None  # RouterConfig: also rejected beyond this predicted wait
    max_video_queue_wait_s: float | None = None
    text_encoder: TextEncoderSpec = TextEncoderSpec()
    # Image VAE decoder replicas; 0: images decode on their worker, as videos always do
    # (`vae_decoder.on_workers`).
    decoders: int = 1
    # Share of the per-request overhead spent before the router sees the request (the rest
    # after decoding): half in, half out.
    submit_overhead_share: float = 0.5
    # Cores of the one CPU host every component shares (a CPU box running the whole app);
    # None: each worker, encoder and decoder has its own device (a GPU cluster).
    host_cpus: float | None = None
    # Whether a forward may mix requests with different LoRAs (CoreConfig.lora_batches).
    lora_batches: LoraBatching = LoraBatching.MIXED
    lora_resident: int = 32  # LoRAs each worker keeps (lora_loading.max_resident)
    # SynerDiff's worker-level mechanisms (`sim.synerdiff`): images decode on their worker (needs
    # decoders 0) beside its rounds, chunked, with skip-CFG, the sequence planner and the
    # controller as switched; None: a worker decodes what it finishes after its plan's last step.
    synerdiff: SynerDiffSim | None = None
    # Models whose workers run a step's resolutions as one forward (`workers.pack_resolutions`,
    # for the models whose family packs): their rounds are priced as the live router prices them.
    packing: tuple[str, ...] = ()
    # `workers.autoscaling`: the pool grows and shrinks as the live router's scaler decides, from
    # `workers` at the start (None: a fixed pool). A worker it starts serves `worker_start_s` later
    # (a node coming up and the worker loading its models).
    scaling: ScalingSpec | None = None
    worker_start_s: float = 30.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")
        if self.decoders < 0:
            raise ValueError(f"decoders must be >= 0, got {self.decoders}")
        if not 0.0 <= self.submit_overhead_share <= 1.0:
            raise ValueError(f"submit_overhead_share must be in [0, 1], got {self.submit_overhead_share}")
        if self.synerdiff is not None and self.decoders:
            raise ValueError("synerdiff decodes images on the workers: it needs decoders=0")
        if self.host_cpus is not None and not self.host_cpus > 0:
            raise ValueError(f"host_cpus must be > 0 or None, got {self.host_cpus}")
        if self.scaling is not None and not self.scaling.min_workers <= self.workers <= self.scaling.max_workers:
            raise ValueError(f"scaling: need min_workers <= workers <= max_workers, got {self.scaling}, {self.workers}")
        if self.worker_start_s < 0:
            raise ValueError(f"worker_start_s must be >= 0, got {self.worker_start_s}")

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["policy_options"] = dict(self.policy_options)
        out["lora_batches"] = self.lora_batches.value
        out["synerdiff"] = None if self.synerdiff is None else self.synerdiff.describe()
        out["packing"] = list(self.packing)
        out["scaling"] = None if self.scaling is None else asdict(self.scaling)
        return out


@dataclass(frozen=True)
class RequestTrace:
    """Everything the simulator knows about one request; seconds from the run's start."""

    index: int
    request_id: str
    kind: str  # image | video
    model: str
    width: int
    height: int
    frames: int
    steps: int
    cfg: bool
    request_class: str
    arrival_s: float  # the workload offset (the client's send time)
    submit_s: float | None  # RouterCore.submit
    ready_s: float | None  # text embeddings arrived
    admit_s: float | None  # first admitted on a worker
    worker_id: str | None  # the worker (first of the SP group) it last ran on
    finish_s: float | None  # last denoising step reported
    stored_s: float | None  # decoded (image) or stored (video): the router's last stage ends
    completion_s: float | None  # the response is complete
    deadline_s: float | None  # arrival + slo_s
    status: str  # finished | rejected | failed | unfinished
    pauses: int = 0
    degrees: tuple[int, ...] = ()  # the SP degree of every step, in order

    @property
    def latency_s(self) -> float | None:
        return None if self.completion_s is None else self.completion_s - self.arrival_s

    @property
    def met_slo(self) -> bool:
        return (self.status == "finished" and self.deadline_s is not None
                and self.completion_s is not None and self.completion_s <= self.deadline_s)

    def to_record(self) -> RequestRecord:
        return record_of(self)


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    traces: tuple[RequestTrace, ...]
    busy_s: Mapping[str, float]  # per worker: seconds spent executing plans
    rounds: int  # plans executed by workers
    decisions: int  # policy calls (RouterCore.schedule passes)
    events: int
    end_s: float  # simulated time of the last event
    wall_s: float  # real time the simulation took
    decision_wall_s: tuple[float, ...]  # each RouterCore.schedule call's wall time
    text_encoder_busy_s: float  # on the text encoder, or on the workers when they encode prompts
    decoder_busy_s: float
    host_peak_jobs: int | None = None  # most jobs sharing the CPU host at once (host_cpus set)
    # Device seconds of ControlNet calls on the ControlNet service (0 when the denoisers run them).
    controlnet_busy_s: float = 0.0
    forwards: int = 0  # denoiser forwards run (a step of a plan with three groups is three)
    lora_loads: int = 0  # LoRAs brought into a worker's memory
    # The pool's size (workers serving, starting or draining) after each change, from (0, workers).
    pool: tuple[tuple[float, int], ...] = ()
    worker_s: float = 0.0  # seconds workers were held (started to removed, or to the end): what the pool cost

    @property
    def plan_wall_s(self) -> float:
        return sum(self.decision_wall_s)

    def records(self, kind: str | None = None) -> list[RequestRecord]:
        return [t.to_record() for t in self.traces if kind is None or t.kind == kind]

    def summary(self, offered_rps: float | None = None, kind: str | None = None) -> Summary:
        return summarize(self.records(kind), self.busy_s, offered_rps)

    def stage_means(self, kind: str) -> dict[str, float | None]:
        """Mean seconds of each stage of the finished requests of one kind ("image" or "video"),
        cut as the live router's `stepserve_request_stage_seconds` cuts them: text_encode (submit
        to embeddings), queue (to first admission), denoise (to the last step), step (denoise /
        steps), decode (to the decoded image or the stored video)."""
        done = [t for t in self.traces if t.kind == kind and t.status == "finished"]
        stages = {
            "text_encode": [t.ready_s - t.submit_s for t in done],
            "queue": [t.admit_s - t.ready_s for t in done],
            "denoise": [t.finish_s - t.admit_s for t in done],
            "step": [(t.finish_s - t.admit_s) / t.steps for t in done],
            "decode": [t.stored_s - t.finish_s for t in done],
        }
        return {stage: sum(values) / len(values) if values else None for stage, values in stages.items()}


class _Handle:
    """What `send` hands the core: filled with the output when the plan has run."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


class _Pending:
    """Mutable per-request state while the run goes on; frozen into a RequestTrace at the end."""

    __slots__ = ("request", "spec", "texts", "submit_s", "ready_s", "finish_s", "stored_s", "completion_s", "status",
                 "worker_id", "state")

    def __init__(self, request: ScheduledRequest, spec: RequestSpec) -> None:
        self.request = request
        self.spec = spec
        self.texts = _texts(spec)
        self.submit_s = self.ready_s = self.finish_s = self.stored_s = self.completion_s = None
        self.worker_id: str | None = None
        self.status = "unfinished"
        self.state = None  # the core's last word on it, kept when the core forgets it


class _Queued:
    __slots__ = ("plan", "admissions", "handles", "gang")

    def __init__(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...], handles: list[_Handle], gang: int):
        self.plan, self.admissions, self.handles, self.gang = plan, admissions, handles, gang


class _Executing:
    """The plan a lane runs: when it started, how many of its steps it will run, and the token
    of the report event that ends it (a cut schedules an earlier one)."""

    __slots__ = ("queued", "running", "started", "steps", "job", "token")

    def __init__(self, queued: _Queued, running: Any, started: float, steps: int, token: int) -> None:
        self.queued, self.running, self.started, self.steps, self.token = queued, running, started, steps, token
        self.job: int | None = None  # its job on the shared host, if there is one


class _Lane:
    """One worker's plan FIFO, as Ray queues one caller's calls to an actor."""

    __slots__ = ("worker", "fifo", "executing", "busy_s", "interrupted", "tokens")

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.fifo: deque[_Queued] = deque()
        self.executing: _Executing | None = None
        self.busy_s = 0.0
        self.interrupted = 0  # the plan id the core last asked to cut short
        self.tokens = 0


class Simulation:
    def __init__(self, requests: Sequence[ScheduledRequest], cost: Any, config: SimConfig = SimConfig()) -> None:
        self.config = config
        self.cost = cost
        self.events = EventQueue()
        self.host = None if config.host_cpus is None else SharedHost(
            config.host_cpus, self.events, getattr(cost, "host_slowdown", None),
            cost.host_idle_cores() if hasattr(cost, "host_idle_cores") else 0.0)
        # The router's CPU per step reported: beside the worker's next step, but on a shared
        # host it takes a core too.
        on_host = self.host is not None and hasattr(cost, "router_cpu_seconds")
        self._router_cpu_s = cost.router_cpu_seconds() if on_host else 0.0
        self._run_work = self._delay if self.host is None else self.host.run
        options = options_for_workers(config.policy, config.policy_options, config.max_batch_size, bool(config.packing))
        policy = make_policy(config.policy, options, cost if needs_costs(config.policy) else None)
        worker_ids = [f"w{i}" for i in range(config.workers)]
        self._next_worker = config.workers
        core_config = CoreConfig(
            pipeline_depth=config.pipeline_depth, pipeline_lead_s=config.pipeline_lead_s,
            max_plan_s=config.max_plan_s, checkpoint_interval_s=None, images_decode_on_workers=not config.decoders,
            text_encode_on_workers=not config.text_encoder.replicas,
            max_queued={RequestKind.T2I: config.max_queued_images, RequestKind.T2V: config.max_queued_videos},
            max_wait_s={RequestKind.T2I: config.max_image_queue_wait_s,
                        RequestKind.T2V: config.max_video_queue_wait_s},
            lora_batches=config.lora_batches, lora_resident=config.lora_resident)
        self.core = RouterCore(policy, [WorkerSlot(wid, config.max_batch_size, i) for i, wid in enumerate(worker_ids)],
                               core_config, cost)
        self._round_cache: dict[tuple[BatchShape, ...], float] = {}
        self.encoder = (TextEncoderService(config.text_encoder, self.events, self._run_work,
                                           cost.text_encode_seconds, self._on_ready)
                        if config.text_encoder.replicas else None)
        self._worker_encode_s = 0.0  # text encoding the workers did (no text encoder)
        self.lanes = {wid: self._lane(wid) for wid in worker_ids}
        self._gone: dict[str, _Lane] = {}  # removed workers' lanes, for their totals
        self._held_from = {wid: 0.0 for wid in worker_ids}  # when each worker was started
        self._held_s = 0.0  # removed workers' held seconds
        self._starting: dict[str, None] = {}  # started, not serving yet (a stopped one never serves)
        self._pool: list[tuple[float, int]] = [(0.0, config.workers)]
        self.scaler = None if config.scaling is None else PoolScaler(config.scaling)
        if self.scaler is not None:
            self.events.at(SCALE_INTERVAL_S, self._scale)
        self.decoder = (DecoderService(config.decoders, self.events, self._run_work, self._on_decoded)
                        if config.decoders else None)
        self.pending: dict[str, _Pending] = {}
        # Insertion-ordered (dicts, not sets) throughout: a run must not depend on string hashing.
        self._gangs: dict[tuple[int, str], dict[str, None]] = {}  # (gang, request) -> members arrived
        self._gang = 0
        self._decide_pending = False
        self._wakes: set[float] = set()  # pending wake-up times
        self._blocked: dict[_Lane, None] = {}  # lanes whose next plan waits for a state or a gang
        self.decision_wall: list[float] = []
        self._controlnet_s = getattr(cost, "controlnet_seconds", None)
        self._controlnet_busy_s = 0.0
        self._forwards = 0
        for request in requests:
            if request.model is None:
                raise ValueError(f"request {request.index} has no model; the simulator needs one to cost it")
            rid = f"r{request.index}"
            if rid in self.pending:
                raise ValueError(f"duplicate request index {request.index}")
            spec = _spec_of(request, rid, request.slo_s)
            self.pending[rid] = _Pending(request, spec)
            self.events.at(request.offset_s, self._arrive, self.pending[rid])

    def _lane(self, wid: str) -> _Lane:
        config, cost = self.config, self.cost
        return _Lane(SimWorker(wid, self._round_seconds, self._worker_decode_seconds,
                               encode_cost=None if self.encoder else self._encoding_on_worker(),
                               lora_load_cost=getattr(cost, "lora_load_seconds", None),
                               lora_resident=config.lora_resident, sequencer=self._sequencer()))

    # -- the pool grows and shrinks (the live router's `_scale_loop`) ------------------------

    def _scale(self) -> None:
        now = self.events.now
        for wid in [w for w in self.core.draining_workers if self.core.drained(w)]:
            self.core.remove_worker(wid)
            self._gone[wid] = self.lanes.pop(wid)
            self._held_s += now - self._held_from.pop(wid)
        draining = len(self.core.draining_workers)
        size = len(self.lanes) - draining + len(self._starting)
        target = self.scaler.target(self.core.pool_load(now), size, now)
        for _ in range(target - size):
            wid = f"w{self._next_worker}"
            self._next_worker += 1
            self._starting[wid] = None
            self._held_from[wid] = now
            self.events.at(now + self.config.worker_start_s, self._worker_up, wid, self._next_worker - 1)
        if target < size:
            if self._starting:
                wid = next(reversed(self._starting))
                del self._starting[wid]
                self._held_s += now - self._held_from.pop(wid)
            else:
                by_load = sorted((w for w in self.lanes if w not in self.core.draining_workers),
                                 key=lambda w: (len(self.core.worker_record(w).residents), -self.core.rank(w)))
                if next((w for w in by_load if self.core.drain(w)), None) is not None:
                    self._request_decision()
        pool = len(self.lanes) + len(self._starting)
        if pool != self._pool[-1][1]:
            self._pool.append((now, pool))
        # Ticks go on while anything else will happen, and after that until the pool is back at
        # its minimum (an idle pool drains); never for ever.
        if len(self.events) or pool > self.config.scaling.min_workers:
            self.events.at(now + SCALE_INTERVAL_S, self._scale)

    def _worker_up(self, wid: str, rank: int) -> None:
        if wid not in self._starting:
            return  # stopped before it came up
        del self._starting[wid]
        self.lanes[wid] = self._lane(wid)
        self.core.add_worker(WorkerSlot(wid, self.config.max_batch_size, rank))
        self._request_decision()

    # -- costs -------------------------------------------------------------------------------

    def _delay(self, seconds: float, callback, *args) -> None:
        self.events.at(self.events.now + seconds, callback, *args)

    def _round_seconds(self, shapes: tuple[BatchShape, ...]) -> float:
        seconds = self._round_cache.get(shapes)
        if seconds is None:
            seconds = self._round_cache[shapes] = self.cost.round_seconds(list(shapes))
        return seconds

    def _sequencer(self) -> WorkerSequencer | None:
        if self.config.synerdiff is None:
            return None
        return WorkerSequencer(self.config.synerdiff, self.cost, self.config.max_batch_size,
                               lambda: self.core.queue_length(RequestKind.T2I))

    def _decoded_on_worker(self, spec: RequestSpec) -> bool:
        """A video always; an image when there is no decoder (`vae_decoder.on_workers`)."""
        return spec.is_video or self.decoder is None

    def _worker_decode_seconds(self, spec: RequestSpec) -> float:
        """What a worker spends decoding a request it finishes after its plan: 0 for an image the
        decoder takes, or that decodes in its worker's SynerDiff lane."""
        if not self._decoded_on_worker(spec) or (self.config.synerdiff is not None and not spec.is_video):
            return 0.0
        return self.cost.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames)

    def _encoding_on_worker(self) -> Callable[[Sequence[RequestSpec]], float]:
        """One worker's cost of encoding the prompts of the fresh starts a plan admits: one call
        per model for the texts its own cache lacks, as `DenoiserWorker` encodes them."""
        cache = TextCache(self.config.text_encoder.cache_size)

        def encode(specs: Sequence[RequestSpec]) -> float:
            seconds = 0.0
            for model in dict.fromkeys(spec.model for spec in specs):
                missing = cache.encode(model, [t for spec in specs if spec.model == model for t in _texts(spec)])
                if missing:
                    seconds += self.cost.text_encode_seconds(model, missing)
            self._worker_encode_s += seconds
            return seconds

        return encode

    def _overhead(self, spec: RequestSpec, share: float) -> float:
        return share * self.cost.request_overhead_seconds(spec.model)

    # -- requests ----------------------------------------------------------------------------

    def _arrive(self, entry: _Pending) -> None:
        self._run_work(self._overhead(entry.spec, self.config.submit_overhead_share), self._submit, entry)

    def _submit(self, entry: _Pending) -> None:
        now = self.events.now
        request, spec = entry.request, entry.spec
        out_share = 1 - self.config.submit_overhead_share
        if request.slo_s is not None:
            # The workload's SLO runs from the client's send; the router's from its submit.
            spec = entry.spec = _spec_of(request, spec.request_id, request.slo_s - (now - request.offset_s))
        # What follows the last step (decode, then the rest of the overhead), predicted from the
        # profile as the live router predicts it: the scheduler plans denoising to end that early.
        tail = self.cost.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames) + self._overhead(
            spec, out_share)
        try:
            self.core.submit(spec, now, tail)
        except QueueFullError:
            # The 429 travels back through the same hops.
            self._run_work(self._overhead(spec, out_share), self._complete, entry, "rejected")
            return
        entry.submit_s = now
        if self.encoder is None:  # its worker encodes its prompts when it admits it
            self._on_ready([spec.request_id])
        else:
            self.encoder.submit(spec.request_id, spec.model, entry.texts)

    def _on_ready(self, request_ids: Sequence[str]) -> None:
        now = self.events.now
        for rid in request_ids:
            self.pending[rid].ready_s = now
            self.core.mark_ready(rid, None if self.encoder is None else "embeddings", now)
        self._request_decision()

    def _on_decoded(self, request_id: str, started: float) -> None:
        self._stored(self.pending[request_id])
        self._request_decision()

    def _stored(self, entry: _Pending) -> None:
        """Its output is decoded (image) or stored (video): the core finishes and forgets it, as
        the router does once the result is handed over."""
        rid = entry.spec.request_id
        entry.stored_s = self.events.now
        self.core.complete(rid, self.events.now)
        entry.state = self.core.state(rid)
        self.core.forget(rid)
        self._run_work(self._overhead(entry.spec, 1 - self.config.submit_overhead_share), self._complete, entry,
                       "finished")

    def _complete(self, entry: _Pending, status: str) -> None:
        entry.completion_s = self.events.now
        entry.status = status

    # -- rounds ------------------------------------------------------------------------------

    def _request_decision(self) -> None:
        # Many events land on one instant (a burst of ready requests, a group's members): one
        # decision after all of them, as the live router's single scheduling task makes.
        if not self._decide_pending:
            self._decide_pending = True
            self.events.at(self.events.now, self._decide)

    def _decide(self) -> None:
        self._decide_pending = False
        started = time.perf_counter()
        decision = self.core.schedule(self.events.now, self._send, self._interrupt)
        self.decision_wall.append(time.perf_counter() - started)
        for failure in decision.discard:  # failed by the core, as the live router's are
            entry = self.pending[failure.request_id]
            entry.status, entry.finish_s, entry.state = "failed", self.events.now, self.core.state(failure.request_id)
        wake = decision.wake_at
        if wake is not None and wake not in self._wakes:
            # Asking to be woken now with nothing to do would spin the live router too; here
            # simulated time would stand still.
            if wake <= self.events.now and not decision.plans:
                raise ValueError(f"policy {self.config.policy!r} asked to be woken at {wake!r}, "
                                 f"now={self.events.now!r}, and sent nothing")
            self._wakes.add(wake)
            self.events.at(wake, self._wake, wake)
        for wid in dict.fromkeys(p.worker_id for p in decision.plans):
            self._try_start(self.lanes[wid])

    def _wake(self, at: float) -> None:
        self._wakes.discard(at)
        self._request_decision()

    def _send(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...]) -> list[_Handle]:
        handles = [_Handle() for _ in plan.outputs]
        lane = self.lanes[plan.worker_id]
        # Every member of an SP step is sent in the same decision pass: that pass names the gang.
        lane.fifo.append(_Queued(plan, admissions, handles, self.core.decisions))
        for rid in plan.admit:
            entry = self.pending[rid]
            entry.worker_id = entry.worker_id if any(g.ranks for g in plan.groups) else plan.worker_id
        return handles

    def _interrupt(self, worker_id: str, plan_id: int) -> None:
        """End the plan after the step it is running: the live worker checks between steps."""
        lane = self.lanes[worker_id]
        lane.interrupted = plan_id
        current = lane.executing
        if current is None or current.queued.plan.plan_id != plan_id:
            return  # not started: it runs one step (`_start`)
        head_s, step_s = current.running.head_s, current.running.step_s
        if step_s <= 0:
            return  # none of its forwards runs: it takes no time
        done = self.events.now - current.started if self.host is None else self.host.done_s(current.job)
        # The live worker asks whether to stop only after its first step.
        steps = min(current.steps, max(1, math.floor((done - head_s) / step_s) + 1))
        if steps >= current.steps:
            return
        current.steps = steps
        if self.host is None:
            lane.tokens += 1
            current.token = lane.tokens
            self.events.at(current.started + head_s + steps * step_s, self._report, lane, current.token)
        else:
            self.host.resize(current.job, head_s + steps * step_s)

    def _try_start(self, lane: _Lane) -> None:
        self._blocked.pop(lane, None)
        if lane.executing is not None or not lane.fifo:
            return
        head = lane.fifo[0]
        # A resume waits for the state it resumes from (Ray resolves the reference first).
        if any(a.resume and a.source.value is None for a in head.admissions):
            self._blocked[lane] = None
            return
        for group in head.plan.groups:
            if group.ranks:
                key = (head.gang, group.request_ids[0])
                arrived = self._gangs.setdefault(key, {})
                arrived[lane.worker.worker_id] = None
                if len(arrived) < len(group.ranks):
                    self._blocked[lane] = None
                    return  # the collective waits for every member
        for group in head.plan.groups:
            if group.ranks:
                key = (head.gang, group.request_ids[0])
                members = self._gangs.pop(key, None)
                if members is not None:
                    for wid in members:
                        if wid != lane.worker.worker_id:
                            self._start(self.lanes[wid])
        self._start(lane)

    def _start(self, lane: _Lane) -> None:
        queued = lane.fifo.popleft()
        admissions = {a.spec.request_id: SimAdmission(a.spec, a.source.value if a.resume else None)
                      for a in queued.admissions}
        running = lane.worker.start(queued.plan, admissions)
        plan = queued.plan
        steps = 1 if lane.interrupted == plan.plan_id else plan.steps
        lane.tokens += 1
        current = lane.executing = _Executing(queued, running, self.events.now, steps, lane.tokens)
        seconds = running.head_s + running.step_s * steps + (running.tail_s if steps == plan.steps else 0.0)
        for rid, offset in running.decodes:  # SynerDiff: decodes that end beside its rounds
            self.events.at(self.events.now + running.head_s + offset, self._on_decoded, rid, self.events.now)
        if self.host is None:
            self.events.at(self.events.now + seconds, self._report, lane, current.token)
        else:
            current.job = self.host.run(seconds, self._report, lane, current.token)

    def _report(self, lane: _Lane, token: int) -> None:
        current = lane.executing
        if current is None or current.token != token:
            return  # a cut moved the plan's end earlier
        lane.executing = None
        queued = current.queued
        report, outputs, _ = lane.worker.end(current.running, current.steps)
        now = self.events.now
        self._forwards += current.steps * len(current.running.shapes)
        if self._controlnet_s is not None:
            self._controlnet_busy_s += current.steps * sum(self._controlnet_s(s) for s in current.running.shapes)
        if self._router_cpu_s and current.steps:
            self.host.run(self._router_cpu_s * current.steps, _nothing)
        lane.busy_s += now - current.started  # on a shared host a plan takes longer than its profiled time
        for handle, value in zip(queued.handles, outputs):
            handle.value = value
        outcome = self.core.apply(report, now)
        for rid, _ in outcome.denoised:
            entry = self.pending[rid]
            entry.finish_s = now
            spec = entry.spec
            if self.config.synerdiff is not None and not spec.is_video:
                pass  # decoding in its worker's lane: stored when its last chunk ends
            elif self._decoded_on_worker(spec):  # already decoded: stored at once
                self._stored(entry)
            else:
                self.decoder.submit(rid, self.cost.decode_seconds(spec.model, spec.height, spec.width))
        for rid in outcome.failed:
            entry = self.pending[rid]
            entry.status, entry.finish_s, entry.state = "failed", now, self.core.state(rid)
        self._try_start(lane)
        for other in list(self._blocked):  # a state or a gang member it waited for may be there now
            self._try_start(other)
        self._request_decision()
        if lane.worker.sequencer is not None:  # once the round's decision is made (events at one time run in order)
            self.events.at(now, self._drain_if_idle, lane)

    def _drain_if_idle(self, lane: _Lane) -> None:
        """SynerDiff: a worker that got no plan runs its decodes alone."""
        if lane.executing is None and lane.worker.sequencer.decodes:
            for rid, offset in lane.worker.sequencer.drain():
                self._delay(offset, self._on_decoded, rid, self.events.now)

    # -- running -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        self.events.run()
        wall = time.perf_counter() - started
        lanes = {**self._gone, **self.lanes}
        traces = tuple(self._trace(entry) for entry in self.pending.values())
        return SimResult(
            config=self.config, traces=traces,
            busy_s={wid: lane.busy_s for wid, lane in lanes.items()},
            rounds=sum(lane.worker.rounds for lane in lanes.values()), decisions=self.core.decisions,
            events=self.events.processed, end_s=self.events.now, wall_s=wall,
            decision_wall_s=tuple(self.decision_wall),
            text_encoder_busy_s=self._worker_encode_s if self.encoder is None else self.encoder.busy_s,
            decoder_busy_s=0.0 if self.decoder is None else self.decoder.busy_s,
            host_peak_jobs=None if self.host is None else self.host.peak_jobs,
            controlnet_busy_s=self._controlnet_busy_s, forwards=self._forwards,
            lora_loads=sum(lane.worker.lora_loads for lane in lanes.values()),
            pool=tuple(self._pool), worker_s=self._held_s + sum(self.events.now - t for t in self._held_from.values()),
        )

    def _trace(self, entry: _Pending) -> RequestTrace:
        request, spec = entry.request, entry.spec
        state = entry.state
        if state is None and entry.submit_s is not None:  # still live at the end of the run
            state = self.core.state(spec.request_id)
        if entry.status == "finished" and state.status is not RequestStatus.FINISHED:
            raise AssertionError(f"{spec.request_id} completed but the core says {state.status}")
        admit = None if state is None else state.admit_time
        pauses, degrees = (0, ()) if state is None else (state.pauses, state.degrees)
        return RequestTrace(
            index=request.index, request_id=spec.request_id, kind="video" if spec.is_video else "image",
            model=spec.model, width=spec.width, height=spec.height, frames=spec.num_frames,
            steps=spec.steps_to_run, cfg=spec.uses_cfg, request_class=request.request_class,
            arrival_s=request.offset_s, submit_s=entry.submit_s, ready_s=entry.ready_s, admit_s=admit,
            worker_id=entry.worker_id, finish_s=entry.finish_s, stored_s=entry.stored_s,
            completion_s=entry.completion_s,
            deadline_s=None if request.slo_s is None else request.offset_s + request.slo_s, status=entry.status,
            pauses=pauses, degrees=degrees,
        )


def _nothing() -> None:
    """The end of work that only takes CPU from the others (the router's per-step work)."""


def _texts(spec: RequestSpec) -> tuple[str, ...]:
    """What is encoded for a request: its prompt, and its negative prompt under CFG."""
    return (spec.prompt, spec.negative_prompt) if spec.uses_cfg else (spec.prompt,)


def _spec_of(request: ScheduledRequest, rid: str, slo_s: float | None) -> RequestSpec:
    video = request.is_video
    spec = RequestSpec(
        request_id=rid, model=request.model, prompt=request.prompt, width=request.width, height=request.height,
        num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale, seed=request.seed,
        negative_prompt=request.negative_prompt, kind=RequestKind.T2V if video else RequestKind.T2I,
        num_frames=request.num_frames if video else 1, fps=request.fps,
        slo_s=None if slo_s is None else max(slo_s, 1e-9),
        controlnets=tuple(ControlNetUse(name) for name in request.controlnets),
        loras=tuple(LoraUse(name) for name in request.loras), step_cache=request.step_cache)
    if isinstance(request, ScheduledEdit):
        spec = replace(spec, kind=RequestKind.EDIT, mask_ratio=request.mask_ratio, template_id=request.template_id)
    return spec


def simulate(requests: Sequence[ScheduledRequest], cost: Any, config: SimConfig = SimConfig()) -> SimResult:
    """Run one simulation to the end (every request completed, rejected or stuck)."""
    if config.packing:
        fits = packing_fits(cost, cost) if isinstance(cost, ProfiledCostModel) else None
        cost = packed(cost, config.packing, fits)
    return Simulation(requests, cost, config).run()
