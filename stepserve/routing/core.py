"""The router's state machine: one core for images and videos, under every policy.

No Ray, no asyncio, no clock (`now` is an argument): the router actor wraps it with I/O and the
discrete-event simulator drives it directly, so both make the same decisions from the same
inputs. Policies see frozen snapshots; everything mutable lives here.

A round (`schedule`) is schedule / execute / update in vLLM's sense, for the whole pool:

1. a `ClusterSnapshot` of the requests and the live workers, as the plans already sent will
   leave them (plans are pipelined: a worker holds up to `pipeline_depth` of them, so it never
   idles through the round trip);
2. the policy's `Decision`, checked as a whole (`plan_check.py`) before anything changes; the
   waiting requests it gives up (`Decision.discard`) end FAILED with its reasons first;
3. each plan completed with the router's own parts (drops, checkpoints, finishes), committed
   to the state, and handed to `send`, which returns handles to the data the plan will return
   (exported and checkpointed states, final latents or frames). Handles are opaque here: Ray
   object refs live, tokens in the simulator. Bulk data never passes through the core.

Under a steady policy (`Scheduler.steady`) a plan that nothing would change runs several steps
(`WorkerPlan.steps`, within `CoreConfig.max_plan_s`): the worker loops over its batch locally,
and the router steps in only when one of the batch finishes, or when something happens that
changes the plan: then it cuts the plan short at the worker's next step boundary (`interrupt`)
and plans again from the steps the worker reports. That happens when a request the worker holds
is cancelled, and, under a policy that joins running batches, when a request becomes ready that
no worker took and this one has room for.

Reports come back per worker in plan order (`apply`). A worker that dies loses what it held:
each of those requests resumes from its last checkpoint, or starts over, on another worker
(`worker_lost`), so a fault costs time, not requests.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from stepserve.policies.admission import ClassLoad, LoadReport, admit
from stepserve.policies.base import Scheduler
from stepserve.policies.cost_model import BatchShape, CostModel
from stepserve.policies.types import (
    ClusterSnapshot,
    Decision,
    LoraBatching,
    RequestFailure,
    RequestKind,
    RequestSpec,
    RequestStatus,
    RequestView,
    ShapeKey,
    SnapshotIndex,
    StepReport,
    WorkerPlan,
    WorkerView,
)
from stepserve.routing.plan_check import PlanChecker
from stepserve.routing.pool_scaler import PoolLoad
from stepserve.routing.records import RequestRecord, SentPlan, WorkerRecord, WorkerSlot
from stepserve.routing.step_overhead import StepOverhead


DRAIN_ALPHA = 0.05  # weight of the newest gap between completions in the drain-rate estimate


class QueueFullError(Exception):
    """The request's class is over its admission bound (HTTP 429), or nothing can serve it now
    (503); `retry_after_s` is when to try again."""

    def __init__(self, message: str, status: int = 429, retry_after_s: float | None = None) -> None:
        super().__init__(message, status, retry_after_s)
        self.message, self.status, self.retry_after_s = message, status, retry_after_s

    def __str__(self) -> str:
        return self.message


class DuplicateRequestError(Exception):
    """A request with this id is still live."""


@dataclass(frozen=True)
class CoreConfig:
    pipeline_depth: int = 2  # plans queued per worker: 2 hides the round trip
    # A worker's next plan is decided this long before its current one is predicted to end:
    # long enough to hide the round trip, late enough that the decision sees fresh state (a
    # plan decided a whole step early preempts a step late).
    pipeline_lead_s: float = 0.05
    max_queued: Mapping[RequestKind, int] = field(
        default_factory=lambda: {RequestKind.T2I: 256, RequestKind.T2V: 64})
    max_wait_s: Mapping[RequestKind, float | None] = field(default_factory=dict)
    # A running request's state is copied to host memory at most this often, so a worker fault
    # loses at most this much of its work; None: never (it restarts from step 0).
    checkpoint_interval_s: float | None = 10.0
    max_recoveries: int = 3  # faults one request survives before it fails
    # A steady policy's batch runs several steps in one plan, up to this long, while nothing waits
    # that the worker could take: the router and the hop to the worker are paid once per plan,
    # not per step. A request that arrives meanwhile, or a cancel, cuts the plan short at its next
    # step (see `RouterCore`). 0: a step a plan.
    max_plan_s: float = 0.3
    # A finished image is decoded inside its worker's last plan (`vae_decoder.on_workers`), so
    # that plan's predicted time includes the decode, as it does a video's.
    images_decode_on_workers: bool = False
    # A fresh request's prompts are encoded inside the plan that admits it (`text_encoder.on_workers`),
    # so that plan's predicted time includes the encoding.
    text_encode_on_workers: bool = False
    # Requests with different LoRA sets may share a forward ("mixed": per-request unmerged
    # updates, batched) or not ("per_adapter": one adapter set per forward, the way vLLM-Omni
    # and SGLang batch; the baseline `bench_addons_sim` compares against). Exact either way.
    lora_batches: LoraBatching = LoraBatching.MIXED
    # Edits of templates reuse cached activations (`edit_cache.enabled`): they form batches of
    # their own (`ShapeKey.cached_edit`).
    cached_edits: bool = False
    # LoRAs each worker keeps in its device memory (`lora_loading.max_resident`): the core mirrors
    # what each holds, so a policy can place a request where its LoRAs already are.
    lora_resident: int = 32

    def __post_init__(self) -> None:
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")
        if any(v < 1 for v in self.max_queued.values()):
            raise ValueError(f"max_queued bounds must be >= 1, got {dict(self.max_queued)}")
        if self.pipeline_lead_s < 0:
            raise ValueError(f"pipeline_lead_s must be >= 0, got {self.pipeline_lead_s}")
        if self.lora_resident < 1:
            raise ValueError(f"lora_resident must be >= 1, got {self.lora_resident}")
        if not (math.isfinite(self.max_plan_s) and self.max_plan_s >= 0):
            raise ValueError(f"max_plan_s must be a finite number >= 0, got {self.max_plan_s}")
        if self.checkpoint_interval_s is not None and self.checkpoint_interval_s < 0:
            raise ValueError(f"checkpoint_interval_s must be >= 0 or None, got {self.checkpoint_interval_s}")


@dataclass(frozen=True)
class AdmissionRef:
    """The one message that makes a request resident on a worker (beside its `WorkerPlan`): its
    spec and the handle of its text conditioning (a fresh start: the text encoder's
    `engine.text_encoding.Pair`, or None when the worker encodes the prompts itself) or of the
    state another worker exported (`resume`); for a fresh start, the handle of its other inputs
    (an `engine.sampler.RequestInputs`: control images, an edit's pixels), if it has any. Handles
    are Ray object refs live and tokens in the simulator; the worker resolves them into the
    engine's `step_runner.Admission`."""

    spec: RequestSpec
    source: object
    resume: bool = False
    inputs: object | None = None


# `send(plan, admissions)` dispatches a plan and returns one handle per `plan.outputs` entry.
Send = Callable[[WorkerPlan, tuple[AdmissionRef, ...]], Sequence[object]]
# `interrupt(worker_id, plan_id)` asks the worker to end that plan after the step it is running.
Interrupt = Callable[[str, int], None]


@dataclass(frozen=True)
class Outcome:
    """What a report (or a fault) changed that the caller must act on."""

    denoised: tuple[tuple[str, object], ...] = ()  # (id, handle of its latents or frames): decode/store next
    failed: tuple[str, ...] = ()
    recovered: tuple[str, ...] = ()  # lost to a fault; resumes from a checkpoint or starts over
    checkpointed: tuple[tuple[str, Resume], ...] = ()  # checkpoints adopted: what a restart could resume from


@dataclass(frozen=True)
class Resume:
    """A state a request reached: its handle, the steps done, and the SP degree of each."""

    state: object
    steps: int
    degrees: tuple[int, ...]


@dataclass(frozen=True)
class RequestState:
    request_id: str
    kind: RequestKind
    status: RequestStatus
    steps_done: int
    steps_total: int
    workers: tuple[str, ...]
    arrival_time: float
    ready_time: float | None  # its text embeddings existed
    admit_time: float | None
    denoised_time: float | None
    finish_time: float | None
    error: str | None
    pauses: int
    recoveries: int
    degrees: tuple[int, ...]  # the SP degree of every step, in order


class RouterCore:
    def __init__(self, policy: Scheduler, workers: Sequence[WorkerSlot], config: CoreConfig = CoreConfig(),
                 costs: CostModel | None = None) -> None:
        if not workers:
            raise ValueError("RouterCore needs at least one worker")
        self.policy = policy
        self.config = config
        self._workers: dict[str, WorkerRecord] = {}
        for slot in sorted(workers, key=lambda s: s.rank):
            if slot.worker_id in self._workers:
                raise ValueError(f"duplicate worker id {slot.worker_id!r}")
            if slot.max_batch_size < 1:
                raise ValueError(f"worker {slot.worker_id!r}: max_batch_size must be >= 1, got {slot.max_batch_size}")
            self._workers[slot.worker_id] = WorkerRecord(slot, config.lora_resident)
        if len({s.rank for s in workers}) != len(workers):
            raise ValueError("worker ranks must be unique")
        self._requests: dict[str, RequestRecord] = {}
        self._waiting: dict[str, None] = {}  # QUEUED or PAUSED ids
        self._waiting_views: tuple[RequestView, ...] | None = None
        # The snapshot's worker side, kept up to date incrementally: only workers that changed
        # (`_stale`) or whose opening time came (`_openings`, a heap) are rebuilt in a round.
        self._stale: set[str] = set(self._workers)
        self._openings: list[tuple[float, int, str]] = []
        # Lent to each round's snapshot (SnapshotIndex), not copied: a copy would cost O(workers).
        self._worker_views: dict[str, WorkerView] = {}  # live workers, rank order
        self._all_views: dict[str, tuple[RequestView, ...]] = {}  # every view each worker holds
        self._load_counts: dict[tuple[int, int], int] = {}
        self._open_ids: dict[str, None] = {}  # open, holding requests
        self._open_idle_ids: dict[str, None] = {}  # open, holding nothing
        self._tables_version = 0
        self._with_drops: dict[str, None] = {}  # workers holding cancelled requests to forget
        self._with_room: dict[str, None] = {}  # cuttable workers with room in their batch (`_refresh_workers`)
        self._interrupted: dict[str, None] = {}  # workers whose plan was asked to end early, until it reports
        self._draining: dict[str, None] = {}  # workers leaving the pool (`drain`), until removed
        self._counts: dict[RequestKind, dict[RequestStatus, int]] = {k: {} for k in RequestKind}
        self.sp_available = True
        self.overhead = StepOverhead()
        self._costs = costs  # predicts plans' times (pipeline timing, calibration); None: learn them
        # kind -> (last completion, smoothed gap between completions, work left then)
        self._drain: dict[RequestKind, tuple[float | None, float | None, bool]] = {}
        self.load_version = 0
        self.decisions = 0
        self._now = 0.0
        self._check = PlanChecker(self)

    # ---- requests in ----------------------------------------------------------------------

    def submit(self, spec: RequestSpec, now: float, tail_s: float = 0.0, inputs: object | None = None,
               resume: Resume | None = None) -> None:
        """Queue a request. `tail_s`: the predicted time from its last denoising step to its
        response (decode, encoding, the way out); the scheduler plans denoising to end that
        much before the SLO. `inputs`: the handle of its control images, handed to the worker
        that admits it. `resume`: a state it reached before (a checkpoint kept outside the
        router): it waits PAUSED there, ready, and the worker that admits it goes on from it."""
        old = self._requests.get(spec.request_id)
        if old is not None and not old.status.is_terminal:
            raise DuplicateRequestError(f"request {spec.request_id!r} is already {old.status.value}")
        verdict = admit(self.load(), spec.kind.lane)
        if not verdict.admitted:
            raise QueueFullError(verdict.message, verdict.status, verdict.retry_after_s)
        if not (tail_s >= 0 and math.isfinite(tail_s)):
            raise ValueError(f"request {spec.request_id!r}: tail_s must be a finite number >= 0, got {tail_s!r}")
        deadline = math.inf if spec.slo_s is None else now + spec.slo_s - tail_s
        self._requests.pop(spec.request_id, None)
        record = RequestRecord(spec, now, deadline, inputs)
        if resume is not None:
            record.status = RequestStatus.PAUSED
            record.host_state = record.checkpoint = resume.state
            record.host_steps = record.checkpoint_steps = record.steps_done = record.steps_planned = resume.steps
            record.degrees = list(resume.degrees)
            record.ready_time = now
        self._requests[spec.request_id] = record
        self._count(record, +1)
        self._waiting[spec.request_id] = None
        self._waiting_views = None
        self._changed_load()

    def mark_ready(self, request_id: str, conditioning: object | None, now: float) -> None:
        """The request's text embeddings are available (`conditioning` is their handle), or, with
        None, it can be admitted now and its worker encodes its prompts."""
        record = self._requests.get(request_id)
        if record is not None and not record.status.is_terminal:  # may arrive after a cancel
            record.conditioning = conditioning
            record.ready_time = now
            self._touch(record)

    # ---- rounds ---------------------------------------------------------------------------

    def schedule(self, now: float, send: Send, interrupt: Interrupt, max_passes: int = 4) -> Decision:
        """Decide and dispatch a round, then cut short the running plans it changed (`interrupt`).
        Returns what was sent, the policy's `wake_at`, and the requests it gave up, which are
        FAILED now (`discard`, each with the policy's reason: the caller tells their clients).

        A pass that exports state (a pause, or the first half of a move) changes what the next
        placement can do, and a worker that got a plan may still be open (its pipeline has room
        and the plan is shorter than the lead): either way the policy is asked again at once,
        up to `max_passes` times.
        """
        sent: list[WorkerPlan] = []
        discarded: list[RequestFailure] = []
        wake_at: float | None = None
        self._now = now
        for _ in range(max_passes):
            decision = self.policy.schedule(self.snapshot(now))
            self.decisions += 1
            self._check.decision(decision)
            for failure in decision.discard:  # before the plans: they count what still waits
                self.fail(failure.request_id, failure.message, now)
                discarded.append(failure)
            plans = {p.worker_id: p for p in decision.plans}
            for wid in self._with_drops:  # cancelled residents still to forget
                if wid not in plans and self.is_open(self._workers[wid]):
                    plans[wid] = WorkerPlan(wid)
            for wid in self._draining:  # a leaving worker hands what it holds back to the queue
                worker = self._workers[wid]
                if worker.residents and self.is_open(worker):
                    plans[wid] = WorkerPlan(wid, export=tuple(worker.residents))
            again = False
            completed = self._complete(list(plans.values()), now)
            # Every member of an SP group admits from the state as it is before the round.
            admissions = [self._admissions(plan) for plan in completed]
            self._count_steps(completed)
            for plan, admitted in zip(completed, admissions):
                sent.append(self._dispatch(plan, admitted, now, send))
                again = again or bool(plan.export) or self.is_open(self._workers[plan.worker_id])
            wake_at = decision.wake_at
            if not again:
                break
        for worker in self._to_interrupt(now):
            plan_id = worker.in_flight[0].plan.plan_id
            worker.interrupted = plan_id
            self._interrupted[worker.slot.worker_id] = None
            self._retime(worker)
            interrupt(worker.slot.worker_id, plan_id)
        opens = self._next_opening()
        if opens is not None:
            wake_at = opens if wake_at is None else min(wake_at, opens)
        return Decision(tuple(sent), wake_at, tuple(discarded))

    def _complete(self, plans: list[WorkerPlan], now: float) -> list[WorkerPlan]:
        """Add the router's parts: drops, checkpoints, finishes (and the releases they imply)."""
        stepped: dict[str, list[str]] = {}  # id -> workers stepping it this round, rank order
        for plan in plans:
            for rid in plan.stepping:
                stepped.setdefault(rid, []).append(plan.worker_id)
        left_waiting = len(self._waiting) - len({rid for plan in plans for rid in plan.admit})
        steps = {plan.worker_id: self._plan_steps(plan, left_waiting) for plan in plans}
        # The members of a group over ranks run its forwards in lockstep: each takes the fewest
        # steps any of them would.
        over_ranks = [(plan.worker_id, group.ranks) for plan in plans for group in plan.groups if group.ranks]
        fewest: dict[tuple[int, ...], int] = {}
        for wid, ranks in over_ranks:
            fewest[ranks] = min(fewest.get(ranks, steps[wid]), steps[wid])
        for wid, ranks in over_ranks:
            steps[wid] = min(steps[wid], fewest[ranks])
        finish: dict[str, list[str]] = {}
        release: dict[str, list[str]] = {}
        checkpoint: dict[str, list[str]] = {}
        interval = self.config.checkpoint_interval_s
        for rid, holders in stepped.items():
            record = self._requests[rid]
            first = min(holders, key=lambda w: self._workers[w].slot.rank)
            if record.steps_planned + steps[first] >= record.spec.steps_to_run:
                finish.setdefault(first, []).append(rid)
                for w in holders:
                    if w != first:
                        release.setdefault(w, []).append(rid)
            elif interval is not None and now - record.checkpoint_time >= interval and not any(
                    rid in p.export for p in plans):
                checkpoint.setdefault(first, []).append(rid)
        out = []
        # What still waits once these plans admit theirs (they leave the queue as they are sent).
        admitted = {rid for plan in plans for rid in plan.admit}
        queued = self.queue_length() - sum(self._requests[rid].status in (RequestStatus.QUEUED, RequestStatus.PAUSED)
                                           for rid in admitted)
        for plan in plans:
            worker = self._workers[plan.worker_id]
            out.append(WorkerPlan(
                plan.worker_id, admit=plan.admit, groups=plan.groups, export=plan.export,
                release=plan.release + tuple(release.get(plan.worker_id, ())), drop=tuple(worker.drops),
                checkpoint=tuple(checkpoint.get(plan.worker_id, ())), finish=tuple(finish.get(plan.worker_id, ())),
                steps=steps[plan.worker_id], plan_id=worker.next_plan_id, queued=queued))
            worker.next_plan_id += 1
        return out

    def _plan_steps(self, plan: WorkerPlan, left_waiting: int) -> int:
        """How many steps the plan runs: one, unless the policy is steady and the plan would come
        back unchanged. Then its batch steps until its first request finishes, within
        `max_plan_s`. Not while something waits that the worker has room for (it would join at
        the next step; under a policy that does not join running batches it would not), nor
        across an export or the admission of a group over ranks. A group over ranks runs as many
        steps on every member (`_complete` takes their fewest) and is never cut short."""
        worker = self._workers[plan.worker_id]
        if (self.config.max_plan_s <= 0 or not self.policy.steady or worker.step_s is None or not plan.groups
                or plan.export or plan.release or plan.admit and any(g.ranks for g in plan.groups)):
            return 1
        if (left_waiting > 0 and self.policy.joins_running
                and len(worker.residents) + len(plan.admit) < worker.slot.max_batch_size):
            return 1
        left = min(self._requests[rid].spec.steps_to_run - self._requests[rid].steps_planned
                   for rid in plan.stepping)
        return max(1, min(left, int(self.config.max_plan_s / max(worker.step_s, 1e-6))))

    def _to_interrupt(self, now: float) -> list[WorkerRecord]:
        """Workers whose plan of several steps this round changed: one that holds a cancelled
        request, and, under a policy that joins running batches, the least loaded with room for
        the ready requests no worker took (one each). A plan is cut only while nothing is
        planned after it and more than a step of it is left."""
        def worth_it(worker: WorkerRecord) -> bool:
            free_at = worker.free_at()
            return worker.cuttable and free_at is not None and free_at - now > (worker.step_s or 0.0)

        out = [self._workers[wid] for wid in {**self._with_drops, **self._draining} if worth_it(self._workers[wid])]
        if not (self.policy.joins_running and self._waiting):
            return out
        if self._stale:
            self._refresh_workers()
        if not self._with_room:
            return out
        # Counted only as far as could matter, so a long queue is not walked every round.
        need = len(self._with_room) + len(self._interrupted)
        ready = sum(1 for _ in itertools.islice((rid for rid in self._waiting if self._requests[rid].ready), need))
        ready -= len(self._interrupted)  # each of those takes one when it reports
        if ready <= 0:
            return out
        room = sorted((self._workers[wid] for wid in self._with_room),
                      key=lambda w: (len(w.residents), w.slot.rank))
        return out + [w for w in room if w not in out and worth_it(w)][:ready]

    def _count_steps(self, plans: list[WorkerPlan]) -> None:
        """Each stepped request advances `plan.steps` steps this round (every member of an SP
        group lists the same step)."""
        degree: dict[str, tuple[int, int]] = {}
        for plan in plans:
            for group in plan.groups:
                for rid in group.request_ids:
                    degree[rid] = (max(1, len(group.ranks)), plan.steps)
        for rid, (d, steps) in degree.items():
            record = self._requests[rid]
            record.steps_planned += steps
            record.degrees.extend([d] * steps)
            self._touch(record)

    def _admissions(self, plan: WorkerPlan) -> tuple[AdmissionRef, ...]:
        out = []
        for rid in plan.admit:
            record = self._requests[rid]
            if record.status is RequestStatus.PAUSED:
                out.append(AdmissionRef(record.spec, record.host_state, True))
            else:
                out.append(AdmissionRef(record.spec, record.conditioning, False, record.inputs))
        return tuple(out)

    def _dispatch(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...], now: float, send: Send) -> WorkerPlan:
        worker = self._workers[plan.worker_id]
        worker.drops.clear()
        self._with_drops.pop(plan.worker_id, None)
        epochs: dict[str, int] = {}
        handles = send(plan, admissions)
        if len(handles) != len(plan.outputs):
            raise ValueError(f"send returned {len(handles)} handles for {len(plan.outputs)} outputs")
        by_output = dict(zip(plan.outputs, handles))
        touched = set(plan.admit) | set(plan.stepping) | set(plan.outputs) | set(plan.release)
        for rid in touched:
            epochs[rid] = self._requests[rid].epoch
        predicted = self._predict(plan, admissions)
        expected = None if predicted is None else predicted + self.overhead.applied[self._kind_of(plan)]
        sent = SentPlan(plan, now, epochs, by_output, predicted, expected,
                     any(self._requests[rid].spec.is_video for rid in plan.finish))
        self._commit(plan, sent, now)
        worker.in_flight.append(sent)
        self._retime(worker)
        return plan

    def _commit(self, plan: WorkerPlan, sent: SentPlan, now: float) -> None:
        """The state as it will be once `plan` has run (its report confirms it)."""
        worker = self._workers[plan.worker_id]
        for rid in plan.admit:
            record = self._requests[rid]
            if record.status is not RequestStatus.RUNNING:
                self._leave_waiting(record)
                if record.status is RequestStatus.PAUSED and record.host_from is None:
                    # The state it resumes from is a valid checkpoint until a newer one exists.
                    record.checkpoint, record.checkpoint_steps = record.host_state, record.host_steps
                self._set_status(record, RequestStatus.RUNNING)
                record.host_state = None
                record.workers = ()
                if record.admit_time is None:
                    record.admit_time = now
                    record.checkpoint_time = now
            record.workers = self._by_rank(record.workers + (plan.worker_id,))
            worker.residents[rid] = None
            if record.spec.loras:
                worker.loras.bring(((record.spec.model, use.name) for use in record.spec.loras),
                                   ((r.model, use.name) for r in (self._requests[o].spec for o in worker.residents)
                                    for use in r.loras))
            self._stale.add(plan.worker_id)
            self._touch(record)
        for rid in plan.export:
            record = self._requests[rid]
            self._set_status(record, RequestStatus.PAUSED)
            record.host_state, record.host_steps = sent.handles[rid], record.steps_planned
            record.host_from = (plan.worker_id, plan.plan_id)
            record.pauses += 1
            self._leave_workers(record)
            self._waiting[rid] = None
            self._waiting_views = None
        for rid in plan.checkpoint:
            sent.checkpoints[rid] = self._requests[rid].steps_planned
            self._requests[rid].checkpoint_time = now  # not again in the next pipelined plan
        for rid in plan.finish:
            self._leave_workers(self._requests[rid])
        for rid in plan.release:
            record = self._requests[rid]
            if plan.worker_id in record.workers:
                record.workers = tuple(w for w in record.workers if w != plan.worker_id)
            worker.residents.pop(rid, None)
            self._stale.add(plan.worker_id)
            self._touch(record)

    # ---- reports in -----------------------------------------------------------------------

    def steps_ran(self, report: StepReport) -> int:
        """How many denoising steps the plan `report` answers ran, before it is applied (0: a plan
        no longer in flight, or one that stepped no group)."""
        worker = self._workers.get(report.worker_id)
        sent = None if worker is None else next((s for s in worker.in_flight if s.plan.plan_id == report.plan_id), None)
        if sent is None or not sent.plan.groups:
            return 0
        return sent.plan.steps if report.steps_run is None else report.steps_run

    def apply(self, report: StepReport, now: float) -> Outcome:
        """Fold in a worker's report of its oldest plan in flight; the whole report is checked
        before anything changes."""
        worker = self._worker(report.worker_id)
        if not worker.alive:
            return Outcome()  # its plans were written off when it died
        if worker.incarnation and report.incarnation and report.incarnation != worker.incarnation:
            # A restarted worker ran this plan without the residents it had: everything it held is lost.
            outcome = self.worker_lost(report.worker_id, now)
            self.worker_back(report.worker_id, report.incarnation)
            return outcome
        worker.incarnation = worker.incarnation or report.incarnation
        expected = worker.in_flight[0].plan.plan_id if worker.in_flight else worker.next_plan_id
        if report.plan_id < expected:
            return Outcome()  # a plan written off when the worker was lost: what it did is void
        if not worker.in_flight or report.plan_id != expected:
            raise ValueError(f"worker {report.worker_id!r} reported plan {report.plan_id}, expected {expected}")
        sent = worker.in_flight[0]
        known = set(sent.epochs)
        for rid in [p.request_id for p in report.progress] + [f.request_id for f in report.failed]:
            if rid not in known:
                raise ValueError(f"worker {report.worker_id!r} reported {rid!r}, which plan {report.plan_id} "
                                 f"does not name")
        steps_run = sent.plan.steps if report.steps_run is None else report.steps_run
        if not 1 <= steps_run <= sent.plan.steps:
            raise ValueError(f"worker {report.worker_id!r} ran {steps_run} steps of plan {report.plan_id}, "
                             f"which has {sent.plan.steps}")
        if steps_run < sent.plan.steps and worker.interrupted != report.plan_id:
            raise ValueError(f"worker {report.worker_id!r} cut plan {report.plan_id} short unasked")
        worker.in_flight.popleft()
        worker.interrupted = None
        self._interrupted.pop(report.worker_id, None)
        self._calibrate(worker, sent, now, steps_run)
        self._retime(worker)

        def current(rid: str) -> RequestRecord | None:
            record = self._requests.get(rid)
            if record is None or record.status.is_terminal or record.epoch != sent.epochs[rid]:
                return None
            return record

        failed, recovered, denoised, checkpointed = [], [], [], []
        failures = {f.request_id: f for f in report.failed}
        if steps_run < sent.plan.steps:
            self._cut_short(worker, sent, sent.plan.steps - steps_run,
                            {rid: current(rid) for rid in sent.plan.stepping if rid not in failures})
        for rid, failure in failures.items():
            record = current(rid)
            if record is None:
                continue
            if failure.lost:
                if self._recover(record, now):
                    recovered.append(rid)
                else:
                    failed.append(rid)
            else:
                self._end(record, RequestStatus.FAILED, failure.message, now)
                failed.append(rid)
        for progress in report.progress:
            record = current(progress.request_id)
            if record is not None and progress.request_id not in failures:
                record.steps_done = max(record.steps_done, progress.steps_done)
        for rid, steps in sent.checkpoints.items():
            record = current(rid)
            if record is not None and rid not in failures and steps >= record.checkpoint_steps:
                record.checkpoint, record.checkpoint_steps = sent.handles[rid], steps
                checkpointed.append((rid, Resume(sent.handles[rid], steps, tuple(record.degrees[:steps]))))
        for rid in sent.plan.export:
            record = current(rid)
            if record is not None and rid not in failures and record.host_from == (report.worker_id, report.plan_id):
                record.host_from = None
        for rid in sent.plan.finish:
            record = current(rid)
            if record is not None and rid not in failures and steps_run == sent.plan.steps:
                record.steps_done = record.spec.steps_to_run
                record.denoised_time = now
                self._set_status(record, RequestStatus.DECODING)
                denoised.append((rid, sent.handles[rid]))
        return Outcome(tuple(denoised), tuple(failed), tuple(recovered), tuple(checkpointed))

    def _cut_short(self, worker: WorkerRecord, sent: SentPlan, short: int, stepped: dict[str, RequestRecord | None]) -> None:
        """The plan ran `short` steps fewer than committed (no plan was sent after it, so its
        steps are the last planned): take them back. What it was to finish is still resident
        there: it stays, or, if it ended meanwhile (`stepped` maps it to None), is dropped."""
        wid = worker.slot.worker_id
        for rid, record in stepped.items():
            if record is None:
                if rid in sent.plan.finish:  # the router forgot it there at the commit
                    worker.drops[rid] = None
                    self._with_drops[wid] = None
                continue
            record.steps_planned -= short
            del record.degrees[len(record.degrees) - short:]
            if rid in sent.plan.finish:
                record.workers = (wid,)
                worker.residents[rid] = None
            self._touch(record)
        for rid in sent.checkpoints:
            sent.checkpoints[rid] -= short
        self._stale.add(wid)

    def complete(self, request_id: str, now: float) -> bool:
        """Its output is decoded/stored: the request is FINISHED."""
        record = self._requests.get(request_id)
        if record is None or record.status is not RequestStatus.DECODING:
            return False
        self._end(record, RequestStatus.FINISHED, None, now)
        self._measure_drain(record.spec.kind.lane, now)
        return True

    def _measure_drain(self, kind: RequestKind, now: float) -> None:
        """Smooth the time between completions of a kind while it has work (an idle stretch is
        not slowness), for the load report's predicted waits. Gaps are averaged, then inverted:
        a batch finishes together, and averaging 1/gap would make its near-zero gaps look like
        a rate of thousands per second."""
        last, gap, busy = self._drain.get(kind, (None, None, False))
        if last is not None and busy:
            step = now - last
            gap = step if gap is None else gap + DRAIN_ALPHA * (step - gap)
        still_busy = self.queue_length(kind) + self.count(RequestStatus.RUNNING, kind) > 0
        self._drain[kind] = (now, gap, still_busy)

    def cancel(self, request_id: str, now: float) -> bool:
        return self._end_early(request_id, RequestStatus.CANCELLED, None, now)

    def fail(self, request_id: str, message: str, now: float) -> bool:
        """End a live request as FAILED from outside its worker (e.g. its decode failed)."""
        return self._end_early(request_id, RequestStatus.FAILED, message, now)

    def _end_early(self, request_id: str, status: RequestStatus, message: str | None, now: float) -> bool:
        record = self._requests.get(request_id)
        if record is None or record.status.is_terminal:
            return False
        self._end(record, status, message, now)
        return True

    # ---- faults ---------------------------------------------------------------------------

    def worker_lost(self, worker_id: str, now: float) -> Outcome:
        """The worker died (or restarted): every request whose state or output it held resumes
        from its last checkpoint elsewhere. Nothing is sent to it until `worker_back`."""
        worker = self._worker(worker_id)
        if not worker.alive:
            return Outcome()
        worker.alive = False
        worker.interrupted = None
        worker.loras.clear()  # it restarts empty
        self._interrupted.pop(worker_id, None)
        self._retime(worker)
        lost_plans = {(worker_id, sent.plan.plan_id) for sent in worker.in_flight}
        affected: dict[str, int] = {}
        for sent in worker.in_flight:
            for rid in list(sent.plan.finish) + list(sent.plan.export) + list(sent.plan.checkpoint):
                affected.setdefault(rid, sent.epochs[rid])
        for rid in worker.residents:
            affected.setdefault(rid, self._requests[rid].epoch)
        for rid, record in self._requests.items():
            if record.host_from in lost_plans:
                affected.setdefault(rid, record.epoch)
        worker.in_flight.clear()
        worker.residents.clear()
        worker.drops.clear()
        self._with_drops.pop(worker_id, None)
        recovered, failed = [], []
        for rid, epoch in affected.items():
            record = self._requests[rid]
            if record.status.is_terminal or record.epoch != epoch:
                continue
            if record.status is RequestStatus.DECODING:
                continue  # its output left the worker with the report
            # Checkpoints are adopted only from reported plans, so the one it has survived.
            (recovered if self._recover(record, now) else failed).append(rid)
        self._changed_load()
        return Outcome((), tuple(failed), tuple(recovered))

    def worker_back(self, worker_id: str, incarnation: str = "") -> None:
        """The worker serves again (restarted empty)."""
        worker = self._worker(worker_id)
        worker.alive = True
        worker.incarnation = incarnation
        worker.last_report_at = None
        self._retime(worker)
        self._changed_load()

    # ---- the pool grows and shrinks --------------------------------------------------------

    def add_worker(self, slot: WorkerSlot, incarnation: str = "") -> None:
        """A worker joins the pool (started and loaded): plans go to it from the next round."""
        if slot.worker_id in self._workers:
            raise ValueError(f"duplicate worker id {slot.worker_id!r}")
        if slot.max_batch_size < 1:
            raise ValueError(f"worker {slot.worker_id!r}: max_batch_size must be >= 1, got {slot.max_batch_size}")
        if any(w.slot.rank == slot.rank for w in self._workers.values()):
            raise ValueError(f"worker rank {slot.rank} is taken")
        worker = self._workers[slot.worker_id] = WorkerRecord(slot, self.config.lora_resident)
        worker.incarnation = incarnation
        self._retime(worker)
        self._changed_load()

    def drain(self, worker_id: str) -> bool:
        """Start taking a worker out of the pool: no policy plans for it from now on; its plan of
        several steps is cut at its next step boundary, and then what it holds goes back to the
        queue (its states exported, PAUSED, to resume elsewhere). `drained` says when it holds
        nothing. False (and nothing changes) for the last live worker, for a dead one, and for one
        holding a request over several workers (a sequence-parallel group moves as a whole)."""
        worker = self._worker(worker_id)
        live = [w for w in self._workers.values() if w.alive and not w.draining]
        if worker.draining or not worker.alive or live == [worker]:
            return False
        if any(len(self._requests[rid].workers) > 1 for rid in worker.residents):
            return False
        worker.draining = True
        self._draining[worker_id] = None
        self._stale.add(worker_id)
        return True

    def drained(self, worker_id: str) -> bool:
        """It is draining and holds nothing: `remove_worker` may take it out."""
        worker = self._worker(worker_id)
        return worker.draining and not worker.in_flight and not worker.residents

    def remove_worker(self, worker_id: str) -> None:
        """Take a drained worker (or a dead one that holds nothing) out of the pool for good."""
        worker = self._worker(worker_id)
        if worker.in_flight or worker.residents or (worker.alive and not worker.draining):
            raise ValueError(f"worker {worker_id!r} still holds work or was not drained")
        worker.alive = False
        self._stale.add(worker_id)
        self._refresh_workers()  # its views leave the snapshot's tables
        for table in (self._workers, self._draining, self._interrupted, self._with_drops):
            table.pop(worker_id, None)
        self._changed_load()

    def pool_load(self, now: float, scan: int = 256) -> PoolLoad:
        """The pool's load signal (`pool_scaler`): what runs or waits, and how many of the first
        `scan` waiting requests miss their deadline unless they start now (their steps left at the
        pool's measured step time end past it; the deadline is already early by the request's
        predicted tail)."""
        steps_s = [w.step_s for w in self._workers.values() if w.alive and not w.draining and w.step_s is not None]
        step_s = sum(steps_s) / len(steps_s) if steps_s else 0.0
        late = 0
        for rid in itertools.islice(self._waiting, scan):
            record = self._requests[rid]
            if now + (record.spec.steps_to_run - record.steps_done) * step_s > record.deadline:
                late += 1
        waiting = self.queue_length()
        return PoolLoad(self.count(RequestStatus.RUNNING) + waiting, waiting, late)

    @property
    def draining_workers(self) -> tuple[str, ...]:
        return tuple(self._draining)

    def rerank(self, order: Sequence[str]) -> None:
        """Ranks 0, 1, ... to the workers in `order` (each once): the caller built the workers' world
        again in that order (a world's ranks are contiguous, and the pool changed). Only while no
        SP group is in use, so no plan or request holds the old ranks."""
        if sorted(order) != sorted(self._workers):
            raise ValueError(f"rerank needs every worker once, got {list(order)}")
        if self.sp_in_use:
            raise ValueError("cannot rerank while an SP group is in use")
        for rank, wid in enumerate(order):
            worker = self._workers[wid]
            worker.slot = replace(worker.slot, rank=rank)
        for table in (self._worker_views, self._all_views, self._open_ids, self._open_idle_ids, self._load_counts):
            table.clear()
        self._stale.update(self._workers)  # every view again, in the new rank order

    def set_sp_available(self, available: bool) -> None:
        """Whether SP groups can form: the caller takes the workers' world down when a member
        dies (its size is fixed; the restarted worker must join a new one) and up once rebuilt."""
        self.sp_available = available

    @property
    def sp_in_use(self) -> bool:
        """Some request runs on an SP group, or a plan with an SP step is in flight."""
        if any(len(r.workers) > 1 for r in self._requests.values() if r.status is RequestStatus.RUNNING):
            return True
        return any(g.ranks for w in self._workers.values() for s in w.in_flight for g in s.plan.groups)

    def _recover(self, record: RequestRecord, now: float) -> bool:
        """Put a request whose state was lost back in line: PAUSED at its checkpoint, or QUEUED
        from step 0. False (and FAILED) once it has been lost too often."""
        record.epoch += 1
        record.recoveries += 1
        if record.recoveries > self.config.max_recoveries:
            self._end(record, RequestStatus.FAILED,
                      f"lost to worker faults {record.recoveries} times; giving up", now)
            return False
        self._leave_workers(record, drop=True)
        if record.checkpoint is not None:
            record.host_state, record.host_steps, record.host_from = record.checkpoint, record.checkpoint_steps, None
            record.steps_done = record.steps_planned = record.checkpoint_steps
            self._set_status(record, RequestStatus.PAUSED)
        else:
            record.host_state, record.host_from = None, None
            record.steps_done = record.steps_planned = 0
            self._set_status(record, RequestStatus.QUEUED)
        record.degrees = record.degrees[: record.steps_planned]
        self._waiting[record.spec.request_id] = None
        self._waiting_views = None
        self._touch(record)
        return True

    # ---- reading state --------------------------------------------------------------------

    def state(self, request_id: str) -> RequestState:
        r = self._requests[request_id]
        return RequestState(request_id, r.spec.kind, r.status, r.steps_done, r.spec.steps_to_run, r.workers,
                            r.arrival, r.ready_time, r.admit_time, r.denoised_time, r.finish_time, r.error, r.pauses,
                            r.recoveries, tuple(r.degrees))

    def spec(self, request_id: str) -> RequestSpec:
        return self._requests[request_id].spec

    def forget(self, request_id: str) -> None:
        """Drop a terminal request's record once its result is delivered; unknown ids are a no-op."""
        record = self._requests.get(request_id)
        if record is None:
            return
        if not record.status.is_terminal:
            raise ValueError(f"request {request_id!r} is {record.status.value}; cancel it first")
        del self._requests[request_id]

    def queue_length(self, kind: RequestKind | None = None) -> int:
        kinds = RequestKind if kind is None else (kind,)
        return sum(self._counts[k].get(s, 0) for k in kinds for s in (RequestStatus.QUEUED, RequestStatus.PAUSED))

    def queued_steps(self, lane: RequestKind) -> int:
        """Denoising steps still to run of the requests of `lane` (edits are images) waiting for a
        worker, queued or paused."""
        waiting = (RequestStatus.QUEUED, RequestStatus.PAUSED)
        return sum(r.spec.steps_to_run - r.steps_done for r in self._requests.values()
                   if r.status in waiting and r.spec.kind.lane is lane)

    def count(self, status: RequestStatus, kind: RequestKind | None = None) -> int:
        kinds = RequestKind if kind is None else (kind,)
        return sum(self._counts[k].get(status, 0) for k in kinds)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def rank(self, worker_id: str) -> int:
        """The worker's rank in the workers' world (StepGroup.ranks)."""
        return self._worker(worker_id).slot.rank

    @property
    def live_workers(self) -> int:
        return sum(w.alive for w in self._workers.values())

    def in_flight(self, worker_id: str) -> int:
        return len(self._worker(worker_id).in_flight)

    def is_alive(self, worker_id: str) -> bool:
        return self._worker(worker_id).alive

    def load(self) -> LoadReport:
        classes = {}
        for kind in RequestKind:
            limit = self.config.max_queued.get(kind)
            if limit is None:
                continue
            gap = self._drain.get(kind, (None, None, False))[1]
            running, decoding = self.count(RequestStatus.RUNNING, kind), self.count(RequestStatus.DECODING, kind)
            if kind is RequestKind.T2I and self.config.images_decode_on_workers:
                # Its worker decoded it in its last plan: what is left is handing back the PNG, no
                # backlog to bound. Counted as one, a batch's end would raise the backlog with no
                # arrival, past what an edge counted when it let requests in.
                running, decoding = running + decoding, 0
            classes[kind] = ClassLoad(
                queued=self.queue_length(kind), running=running, decoding=decoding, max_queued=limit,
                drain_per_s=1.0 / gap if gap else None, max_wait_s=self.config.max_wait_s.get(kind))
        return LoadReport(self.load_version, self.live_workers, classes)

    def snapshot(self, now: float) -> ClusterSnapshot:
        self._now = now
        if self._waiting_views is None:
            records = sorted((self._requests[rid] for rid in self._waiting), key=lambda r: r.arrival)
            self._waiting_views = tuple(self._view(r) for r in records)
        openings = self._openings
        while openings and openings[0][0] <= now:  # their plans in flight end within the lead now
            _, timer, wid = heapq.heappop(openings)
            worker = self._workers.get(wid)  # (None: removed since)
            if worker is not None and worker.timer == timer:
                self._stale.add(wid)
        if self._stale:
            self._refresh_workers()
        version = self._tables_version
        index = SnapshotIndex(self._worker_views, self._all_views, tuple(self._open_ids), tuple(self._open_idle_ids),
                              self._load_counts, lambda: self._tables_version == version)
        overhead = tuple((k, v) for k, v in self.overhead.applied_by_kind().items() if v)
        return ClusterSnapshot(now, self._waiting_views, index, self.sp_available, overhead)

    # ---- internals ------------------------------------------------------------------------

    def _worker(self, worker_id: str) -> WorkerRecord:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}") from None

    def worker_record(self, worker_id: str) -> WorkerRecord | None:
        """The worker's record (None: unknown), to read: only the core changes it."""
        return self._workers.get(worker_id)

    def request_record(self, request_id: str) -> RequestRecord | None:
        """The live or retained request's record (None: unknown), to read: only the core changes it."""
        return self._requests.get(request_id)

    def is_open(self, worker: WorkerRecord) -> bool:
        """It may take a plan now: alive, room in its pipeline, and (if busy) its current work
        is predicted to end within the pipeline lead."""
        return worker.alive and self._now >= worker.open_from

    def _retime(self, worker: WorkerRecord) -> None:
        """After its plans in flight, its life or its timing changed: when does it open next?"""
        worker.timer += 1
        if not worker.alive or worker.interrupted is not None or len(worker.in_flight) >= self.config.pipeline_depth:
            worker.open_from = math.inf
        else:
            free_at = worker.free_at() if worker.in_flight else None
            worker.open_from = -math.inf if free_at is None else free_at - self.config.pipeline_lead_s
            if worker.open_from > self._now:
                heapq.heappush(self._openings, (worker.open_from, worker.timer, worker.slot.worker_id))
        self._stale.add(worker.slot.worker_id)

    def _next_opening(self) -> float | None:
        """When the next busy worker opens (for the caller's timer)."""
        openings = self._openings
        while openings:
            worker = self._workers.get(openings[0][2])  # (None: removed since)
            if worker is not None and worker.timer == openings[0][1]:
                break
            heapq.heappop(openings)
        return openings[0][0] if openings else None

    def _refresh_workers(self) -> None:
        """Rebuild the snapshot's parts of the workers that changed."""
        revived = False
        # In rank order: a set's order follows string hashing, and the order the open workers
        # enter the snapshot decides ties in the policies: a run must not depend on it.
        for wid in sorted(self._stale, key=lambda w: self._workers[w].slot.rank):
            worker = self._workers[wid]
            old = self._worker_views.pop(wid, None)
            if old is not None:
                key = (old.max_batch_size, len(old.running))
                self._load_counts[key] -= 1
                if not self._load_counts[key]:
                    del self._load_counts[key]
            self._open_ids.pop(wid, None)
            self._open_idle_ids.pop(wid, None)
            self._all_views.pop(wid, None)
            self._with_room.pop(wid, None)
            if not worker.alive or worker.draining:  # no policy plans for either
                continue
            if worker.cuttable and len(worker.residents) < worker.slot.max_batch_size:
                self._with_room[wid] = None
            revived = revived or old is None
            needing = [self._requests[rid] for rid in worker.residents if self._requests[rid].needs_steps]
            views = tuple(self._view(r) for r in needing)
            is_open = self.is_open(worker)
            view = WorkerView(wid, worker.slot.rank, worker.slot.max_batch_size,
                              tuple(r.spec.request_id for r in needing), open=is_open, busy=bool(worker.in_flight),
                              decoding=any(s.decodes_video for s in worker.in_flight), loras=worker.loras.held())
            self._worker_views[wid] = view
            self._all_views[wid] = views
            key = (view.max_batch_size, len(view.running))
            self._load_counts[key] = self._load_counts.get(key, 0) + 1
            if is_open:
                (self._open_ids if view.running else self._open_idle_ids)[wid] = None
        self._stale.clear()
        if revived:  # rank order, as the snapshot promises
            for table in (self._worker_views, self._all_views, self._open_ids, self._open_idle_ids):
                ordered = sorted(table.items(), key=lambda item: self._workers[item[0]].slot.rank)
                table.clear()
                table.update(ordered)
        self._tables_version += 1  # snapshots lent the tables before are over

    def _by_rank(self, workers: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(workers), key=lambda w: self._workers[w].slot.rank))

    def batch_key(self, spec: RequestSpec) -> ShapeKey:
        """What decides which requests may share a forward (`CoreConfig.lora_batches`)."""
        return spec.batch_key(self.config.lora_batches is LoraBatching.PER_ADAPTER, self.config.cached_edits)

    def _view(self, record: RequestRecord) -> RequestView:
        if record.view is None:
            spec = record.spec
            record.view = RequestView(
                spec.request_id, spec.kind, self.batch_key(spec), spec.rows, record.steps_planned,
                spec.steps_to_run, record.arrival, record.deadline, record.ready, record.status,
                record.workers if record.status is RequestStatus.RUNNING else (),
                tuple(use.name for use in spec.loras), spec.mask_ratio, spec.template_id,
                tuple(dict.fromkeys(use.name for use in spec.controlnets)))
        return record.view

    def _touch(self, record: RequestRecord) -> None:
        """Drop cached views that show this record; call after changing anything a view shows."""
        record.view = None
        if record.status in (RequestStatus.QUEUED, RequestStatus.PAUSED):
            self._waiting_views = None
        self._stale.update(record.workers)

    def _leave_waiting(self, record: RequestRecord) -> None:
        self._waiting.pop(record.spec.request_id, None)
        self._waiting_views = None

    def _leave_workers(self, record: RequestRecord, drop: bool = False) -> None:
        """The request's state leaves every worker holding it (`drop`: tell them to forget it)."""
        rid = record.spec.request_id
        for w in record.workers:
            worker = self._workers[w]
            worker.residents.pop(rid, None)
            self._stale.add(w)
            if drop and worker.alive:
                worker.drops[rid] = None
                self._with_drops[w] = None
        record.workers = ()
        record.view = None

    def _set_status(self, record: RequestRecord, status: RequestStatus) -> None:
        self._count(record, -1)
        record.status = status
        self._count(record, +1)
        record.view = None
        self._changed_load()

    def _count(self, record: RequestRecord, delta: int) -> None:
        counts = self._counts[record.spec.kind.lane]
        counts[record.status] = counts.get(record.status, 0) + delta

    def _end(self, record: RequestRecord, status: RequestStatus, message: str | None, now: float) -> None:
        if record.status in (RequestStatus.QUEUED, RequestStatus.PAUSED):
            self._leave_waiting(record)
        self._leave_workers(record, drop=True)
        self._set_status(record, status)
        record.finish_time = now
        record.error = message
        # Whatever the handles point at can be freed now.
        record.conditioning = record.inputs = record.host_state = record.checkpoint = None

    def _changed_load(self) -> None:
        """What `load` reports changed (a count, the live workers, a drain rate): the edge's long
        poll answers. Not on every plan or report: that made the ingress poll at every step."""
        self.load_version += 1

    def _predict(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...]) -> float | None:
        """The profile's time for the plan: the prompts it encodes, its forwards (one round per
        step) and any decode it ends with."""
        if self._costs is None or not (plan.groups or plan.finish):
            return None
        total = self._encode_seconds(admissions) if self.config.text_encode_on_workers else 0.0
        batches = []
        for group in plan.groups:
            batches.append(BatchShape.of([self._requests[rid].spec for rid in group.request_ids], group))
        total += self._costs.round_seconds(batches) * plan.steps if batches else 0.0
        for rid in plan.finish:
            spec = self._requests[rid].spec
            if spec.is_video or self.config.images_decode_on_workers:
                total += self._costs.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames)
        return total

    def _encode_seconds(self, admissions: tuple[AdmissionRef, ...]) -> float:
        """The profile's time to encode the prompts of the fresh starts a plan admits (a resume
        brings its state), one batch per model as the worker encodes them (its cache may make
        it less)."""
        texts: dict[str, int] = {}
        for a in admissions:
            if not a.resume:
                texts[a.spec.model] = texts.get(a.spec.model, 0) + (2 if a.spec.uses_cfg else 1)
        return sum(self._costs.text_encode_seconds(model, n) for model, n in texts.items())

    def _calibrate(self, worker: WorkerRecord, sent: SentPlan, now: float, steps_run: int) -> None:
        """What the plan cost as the router saw it (from when the worker could start it to its
        report) against the profile's prediction; the difference is the round trip and the
        worker's own overheads, which the scheduler then adds to its predictions."""
        start = sent.sent_at if worker.last_report_at is None else max(sent.sent_at, worker.last_report_at)
        worker.last_report_at = now
        observed = now - start
        plan = sent.plan
        if plan.groups:
            per_step = observed / steps_run
            worker.step_s = per_step if worker.step_s is None else worker.step_s + 0.2 * (per_step - worker.step_s)
        if (sent.predicted_s is None or plan.admit or plan.export or plan.checkpoint or plan.finish
                or steps_run < plan.steps):
            return  # moving state (or a cut) is not in the profile's numbers: calibrate on plain plans
        self.overhead.observe(self._kind_of(plan), observed, sent.predicted_s)

    def _kind_of(self, plan: WorkerPlan) -> RequestKind:
        """Videos' steps are calibrated apart from images' (other shapes, SP all-to-alls)."""
        for group in plan.groups:
            record = self._requests.get(group.request_ids[0])
            if group.ranks or (record is not None and record.spec.is_video):
                return RequestKind.T2V
        return RequestKind.T2I
