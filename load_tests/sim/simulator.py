"""The discrete-event simulator: the real `RouterCore` and policies, with time from a cost model.

What it models, in the live system's order (actors/router.py, deployments/):

1. A request arrives at its workload offset; `submit_overhead_share` of the cost model's fixed
   per-request overhead (HTTP, proxy, ingress hops) passes before `RouterCore.submit`.
2. Its texts (prompt, plus the negative prompt under CFG) go to the text encoder: a queue per
   replica, `@serve.batch` batching, an embeddings cache. When they arrive the router calls
   `mark_ready` and wakes every idle worker loop.
3. One router loop per worker, as `Router._worker_loop`: keep up to `pipeline_depth` plans in
   flight, making the next plan as soon as fewer are in flight; apply reports in order; with
   nothing in flight and an empty plan, wait for a wake (a new ready request) or the plan's
   `wake_at`.
4. A worker executes its plans one after another (`SimWorker`, the StepRunner's twin); each takes
   `cost.round_seconds` of the groups that really ran. Its report goes to `RouterCore.apply`.
5. A finished request goes to the VAE decoder (a FIFO per replica, `decode_seconds`), then the
   rest of the request overhead passes and the response is complete.

With `host_cpus` set, every timed piece of work above (request overhead, text encoding, worker
rounds, decoding) is single-threaded CPU work on one `SharedHost` of that many cores, so they
slow each other down as they do when a whole app shares a CPU box; without it, each has a
device of its own and takes exactly its profiled time.

Plan making, submitting and applying are instantaneous in simulated time: the router's decision
time (milliseconds) is not charged, nor is the plan/report RPC beyond the cost model's per-round
overhead. Cancellations, worker failures and GPU contention between the UNet and a VAE decoder
on the same device (SynerDiff's subject) are not modelled.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stepserve.actors.router_core import QueueFullError, RouterCore, WorkerSlot
from stepserve.policies import make_policy
from stepserve.policies.cost_model import GroupShape
from stepserve.policies.types import RequestSpec, RequestStatus, StepReport, WorkerPlan

from ..metrics import Summary, summarize
from ..records import RequestRecord, record_of
from ..workload import ScheduledRequest
from .events import EventQueue
from .host import SharedHost
from .services import DecoderService, TextEncoderService, TextEncoderSpec
from .worker import SimWorker


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    max_batch_size: int = 8  # per worker (configs/local.yaml; SynerDiff's BS=8)
    policy: str = "continuous"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    pipeline_depth: int = 2  # RouterConfig.pipeline_depth
    max_queue_len: int = 256  # RouterConfig.max_queue_len: beyond it a request is rejected (429)
    text_encoder: TextEncoderSpec = TextEncoderSpec()
    decoders: int = 1  # VAE decoder replicas
    # Share of the per-request overhead spent before the router sees the request (the rest
    # after decoding): half in, half out.
    submit_overhead_share: float = 0.5
    # Cores of the one CPU host every component shares (a CPU box running the whole app);
    # None: each worker, encoder and decoder has its own device (a GPU cluster).
    host_cpus: float | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")
        if self.decoders < 1:
            raise ValueError(f"decoders must be >= 1, got {self.decoders}")
        if not 0.0 <= self.submit_overhead_share <= 1.0:
            raise ValueError(f"submit_overhead_share must be in [0, 1], got {self.submit_overhead_share}")
        if self.host_cpus is not None and not self.host_cpus > 0:
            raise ValueError(f"host_cpus must be > 0 or None, got {self.host_cpus}")

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["policy_options"] = dict(self.policy_options)
        return out


@dataclass(frozen=True)
class RequestTrace:
    """Everything the simulator knows about one request; seconds from the run's start."""

    index: int
    request_id: str
    model: str
    width: int
    height: int
    steps: int
    cfg: bool
    request_class: str
    arrival_s: float  # the workload offset (the client's send time)
    submit_s: float | None  # RouterCore.submit
    ready_s: float | None  # text embeddings arrived
    admit_s: float | None  # admitted on a worker
    worker_id: str | None
    finish_s: float | None  # last denoising step reported
    decode_start_s: float | None
    completion_s: float | None  # the response is complete
    deadline_s: float | None  # arrival + slo_s
    status: str  # finished | rejected | failed | unfinished

    @property
    def latency_s(self) -> float | None:
        return None if self.completion_s is None else self.completion_s - self.arrival_s

    def to_record(self) -> RequestRecord:
        return record_of(self)


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    traces: tuple[RequestTrace, ...]
    busy_s: Mapping[str, float]  # per worker: seconds spent executing rounds
    rounds: int  # plans executed by workers
    plan_calls: int  # RouterCore.next_plan calls
    events: int
    end_s: float  # simulated time of the last event
    wall_s: float  # real time the simulation took
    plan_wall_s: float  # of which inside RouterCore.next_plan (snapshot + policy)
    text_encoder_busy_s: float
    decoder_busy_s: float
    host_peak_jobs: int | None = None  # most jobs sharing the CPU host at once (host_cpus set)

    def records(self) -> list[RequestRecord]:
        return [t.to_record() for t in self.traces]

    def summary(self, offered_rps: float | None = None) -> Summary:
        return summarize(self.records(), self.busy_s, offered_rps)


class _Pending:
    """Mutable per-request state while the run goes on; frozen into a RequestTrace at the end."""

    __slots__ = ("request", "spec", "texts", "submit_s", "ready_s", "admit_s", "worker_id", "finish_s",
                 "decode_start_s", "completion_s", "status")

    def __init__(self, request: ScheduledRequest, spec: RequestSpec) -> None:
        self.request = request
        self.spec = spec
        self.texts = (spec.prompt, spec.negative_prompt) if spec.uses_cfg else (spec.prompt,)
        self.submit_s = self.ready_s = self.admit_s = self.finish_s = None
        self.decode_start_s = self.completion_s = None
        self.worker_id = None
        self.status = "unfinished"


class _Loop:
    """The router's loop for one worker (Router._worker_loop), plus the worker's plan FIFO."""

    __slots__ = ("worker", "in_flight", "idle", "token", "fifo", "executing", "started", "busy_s")

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.in_flight = 0  # plans sent whose reports are not applied yet
        self.idle = True  # waiting for a wake or wake_at
        self.token = 0  # invalidates stale wake_at timers
        self.fifo: deque[WorkerPlan] = deque()  # sent, not started
        self.executing = False
        self.started = 0.0  # when the executing plan started
        self.busy_s = 0.0  # time spent executing plans


class Simulation:
    def __init__(self, requests: Sequence[ScheduledRequest], cost: Any, config: SimConfig = SimConfig()) -> None:
        self.config = config
        self.cost = cost
        self.events = EventQueue()
        self.host = None if config.host_cpus is None else SharedHost(
            config.host_cpus, self.events, getattr(cost, "host_slowdown", None))
        self._run_work = self._delay if self.host is None else self.host.run
        policy = make_policy(config.policy, dict(config.policy_options))
        worker_ids = [f"w{i}" for i in range(config.workers)]
        self.core = RouterCore(policy, [WorkerSlot(wid, config.max_batch_size) for wid in worker_ids],
                               config.max_queue_len)
        self._round_cache: dict[tuple, float] = {}
        self.loops = {wid: _Loop(SimWorker(wid, self._round_seconds)) for wid in worker_ids}
        self.encoder = TextEncoderService(config.text_encoder, self.events, self._run_work,
                                          cost.text_encode_seconds, self._on_ready)
        self.decoder = DecoderService(config.decoders, self.events, self._run_work, self._on_decoded)
        self.pending: dict[str, _Pending] = {}
        self._order: list[_Pending] = []
        self._specs: dict[str, RequestSpec] = {}  # live requests, for worker admissions
        self._overhead: dict[str, float] = {}
        self.plan_calls = 0
        self.plan_wall_s = 0.0
        # The loops start, plan once (nothing to do yet) and wait, as the live ones do.
        self.events.at(0.0, self._wake_all)
        for request in requests:
            if request.model is None:
                raise ValueError(f"request {request.index} has no model; the simulator needs one to cost it")
            spec = RequestSpec(
                request_id=f"r{request.index}", model=request.model, prompt=request.prompt, width=request.width,
                height=request.height, num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale, seed=request.seed, negative_prompt=request.negative_prompt,
            )
            if spec.request_id in self.pending:
                raise ValueError(f"duplicate request index {request.index}")
            entry = _Pending(request, spec)
            self.pending[spec.request_id] = entry
            self._order.append(entry)
            self.events.at(request.offset_s, self._arrive, entry)

    # -- costs -------------------------------------------------------------------------------

    def _delay(self, seconds: float, callback, *args) -> None:
        self.events.at(self.events.now + seconds, callback, *args)

    def _round_seconds(self, shapes: tuple[tuple[str, int, int, int], ...]) -> float:
        seconds = self._round_cache.get(shapes)
        if seconds is None:
            seconds = self.cost.round_seconds([GroupShape(m, h, w, rows) for m, h, w, rows in shapes])
            self._round_cache[shapes] = seconds
        return seconds

    def _request_overhead(self, model: str) -> float:
        if model not in self._overhead:
            self._overhead[model] = self.cost.request_overhead_seconds(model)
        return self._overhead[model]

    # -- requests ----------------------------------------------------------------------------

    def _arrive(self, entry: _Pending) -> None:
        delay = self.config.submit_overhead_share * self._request_overhead(entry.spec.model)
        if delay > 0:
            self._run_work(delay, self._submit, entry)
        else:
            self._submit(entry)

    def _submit(self, entry: _Pending) -> None:
        now = self.events.now
        try:
            self.core.submit(entry.spec, now)
        except QueueFullError:
            # The 429 travels back through the same hops.
            tail = (1 - self.config.submit_overhead_share) * self._request_overhead(entry.spec.model)
            self._run_work(tail, self._complete, entry, "rejected")
            return
        entry.submit_s = now
        self._specs[entry.spec.request_id] = entry.spec
        self.encoder.submit(entry.spec.request_id, entry.spec.model, entry.texts)

    def _on_ready(self, request_ids: Sequence[str]) -> None:
        now = self.events.now
        for rid in request_ids:
            self.pending[rid].ready_s = now
            self.core.mark_ready(rid)
        self._wake_all()

    def _on_decoded(self, request_id: str, started: float) -> None:
        entry = self.pending[request_id]
        entry.decode_start_s = started
        tail = (1 - self.config.submit_overhead_share) * self._request_overhead(entry.spec.model)
        self._run_work(tail, self._complete, entry, "finished")

    def _complete(self, entry: _Pending, status: str) -> None:
        entry.completion_s = self.events.now
        entry.status = status

    # -- the router's worker loops -----------------------------------------------------------

    def _wake_all(self) -> None:
        for loop in self.loops.values():
            if loop.idle:
                loop.idle = False
                self._pump(loop)

    def _wake_timer(self, loop: _Loop, token: int) -> None:
        if loop.idle and loop.token == token:
            loop.idle = False
            self._pump(loop)

    def _pump(self, loop: _Loop) -> None:
        """Router._worker_loop from where it resumes until it would block again."""
        depth = self.config.pipeline_depth
        wid = loop.worker.worker_id
        while True:
            plan = None
            if loop.in_flight < depth:
                plan = self._next_plan(wid)
                if not plan.is_empty:
                    self._send(loop, plan)
                    continue
            if loop.in_flight:
                return  # awaiting the oldest report; _report resumes the loop
            loop.idle = True
            loop.token += 1
            if plan.wake_at is not None:
                # Asking to be woken now with nothing to do would spin the live router too (it
                # would re-plan at once, forever); here simulated time would stand still.
                if not math.isfinite(plan.wake_at) or plan.wake_at <= self.events.now:
                    raise ValueError(f"policy {self.config.policy!r} returned an empty plan with "
                                     f"wake_at={plan.wake_at!r} at now={self.events.now!r}")
                self.events.at(plan.wake_at, self._wake_timer, loop, loop.token)
            return

    def _next_plan(self, worker_id: str) -> WorkerPlan:
        now = self.events.now
        start = time.perf_counter()
        plan = self.core.next_plan(worker_id, now)
        self.plan_wall_s += time.perf_counter() - start
        self.plan_calls += 1
        for rid in plan.admit:
            entry = self.pending[rid]
            entry.admit_s = now
            entry.worker_id = worker_id
        return plan

    def _send(self, loop: _Loop, plan: WorkerPlan) -> None:
        loop.in_flight += 1
        loop.fifo.append(plan)
        if not loop.executing:
            self._start_next(loop)

    def _start_next(self, loop: _Loop) -> None:
        plan = loop.fifo.popleft()
        loop.executing = True
        loop.started = self.events.now
        report = loop.worker.execute(plan, self._specs)
        self._run_work(report.duration_s, self._report, loop, report)

    def _report(self, loop: _Loop, report: StepReport) -> None:
        # The worker moves on to its next queued plan at once; the router applies this report.
        loop.executing = False
        loop.busy_s += self.events.now - loop.started
        if loop.fifo:
            self._start_next(loop)
        loop.in_flight -= 1
        now = self.events.now
        for rid in self.core.apply(report, now):
            entry = self.pending[rid]
            state = self.core.state(rid)
            self.core.forget(rid)  # as Router.submit does once the result is handed over
            self._specs.pop(rid, None)
            if state.status is RequestStatus.FINISHED:
                entry.finish_s = now
                spec = entry.spec
                self.decoder.submit(rid, self.cost.decode_seconds(spec.model, spec.height, spec.width))
            else:
                entry.status = "failed"
                entry.finish_s = now
        self._pump(loop)

    # -- running -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        self.events.run()
        wall = time.perf_counter() - started
        traces = tuple(self._trace(entry) for entry in self._order)
        return SimResult(
            config=self.config, traces=traces,
            busy_s={wid: loop.busy_s for wid, loop in self.loops.items()},
            rounds=sum(loop.worker.rounds for loop in self.loops.values()),
            plan_calls=self.plan_calls, events=self.events.processed, end_s=self.events.now, wall_s=wall,
            plan_wall_s=self.plan_wall_s, text_encoder_busy_s=self.encoder.busy_s, decoder_busy_s=self.decoder.busy_s,
            host_peak_jobs=None if self.host is None else self.host.peak_jobs,
        )

    @staticmethod
    def _trace(entry: _Pending) -> RequestTrace:
        request, spec = entry.request, entry.spec
        return RequestTrace(
            index=request.index, request_id=spec.request_id, model=spec.model, width=spec.width, height=spec.height,
            steps=spec.num_inference_steps, cfg=spec.uses_cfg, request_class=request.request_class,
            arrival_s=request.offset_s, submit_s=entry.submit_s, ready_s=entry.ready_s, admit_s=entry.admit_s,
            worker_id=entry.worker_id, finish_s=entry.finish_s, decode_start_s=entry.decode_start_s,
            completion_s=entry.completion_s,
            deadline_s=None if request.slo_s is None else request.offset_s + request.slo_s,
            status=entry.status,
        )


def simulate(requests: Sequence[ScheduledRequest], cost: Any, config: SimConfig = SimConfig()) -> SimResult:
    """Run one simulation to the end (every request completed, rejected or stuck)."""
    return Simulation(requests, cost, config).run()
