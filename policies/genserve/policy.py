"""GenServe as a policy of the one scheduler: every round, `decide_round` over the whole pool,
then the decision as plans for the workers that are open now.

The solver decides which videos run at which SP degree on which workers and which image batches
run where; this file only turns that into the per-worker plan vocabulary, acting on open
workers and leaving the rest of the decision to the next round (a worker that is not open
picks up its part when it is, and the round is decided again then):

- a video that keeps its group steps on every member (one SP `StepGroup` with the group's
  ranks), once every member is open;
- a paused video leaves its group at the step boundary: the first member exports its state to
  host memory, the others release their copies;
- a video that moves (another group or degree) is exported the same way; the router decides
  again at once, and the next round resumes it on its new group, which is what makes a move
  exact: every member imports the same host state;
- a queued or paused video starts or resumes on a group whose members are all open and hold no
  other running video; a worker given to a video sheds the idle images it holds;
- an image batch runs on its worker: members waiting are admitted, members resident elsewhere
  are exported from there (they join a later round), members resident there step.

A worker that is open but still busy (its next plan is pipelined: decided just before its
current one ends, to hide the round trip) takes only continuations: the next step of the video
it holds, or of the images resident on it. Starts, moves, pauses and admissions wait until it
is free, so they are decided on the state at its boundary: a structural change decided a step
early is a step stale (measured: video SLO attainment fell from 61% to 29% with a 50 ms lead).
With `admit_busy` (the composed policy's) a busy worker's plan also admits waiting images into
the room its batch has: an admission moves nobody, and without it a pipelining router's worker
is only ever free once its batch has drained.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from stepserve.policies.base import group_by_shape
from stepserve.policies.cost_model import computed_share
from stepserve.policies.genserve.costs import MemoizedCosts, ObservedOverheadCosts, StepCosts
from stepserve.policies.genserve.scheduler import decide_round
from stepserve.policies.genserve.types import (
    GenServeConfig,
    ImageRequest,
    RoundDecision,
    RoundInput,
    VideoAction,
    VideoJob,
    VideoStatus,
)
from stepserve.policies.registry import register_policy
from stepserve.policies.types import (
    ClusterSnapshot,
    Decision,
    RequestKind,
    RequestStatus,
    RequestView,
    StepGroup,
    WorkerPlan,
    WorkerView,
)

_VIDEO_STATUS = {RequestStatus.QUEUED: VideoStatus.QUEUED, RequestStatus.PAUSED: VideoStatus.PAUSED,
                 RequestStatus.RUNNING: VideoStatus.RUNNING}


@register_policy("genserve", GenServeConfig)
class GenServePolicy:
    name: str  # set by register_policy
    needs_costs = True
    steady = False  # slack moves with the clock: it may preempt at any step
    joins_running = True  # a round may put a waiting image into any worker's batch
    splits_cfg = False  # it splits videos by sequence, never a CFG request's rows

    def __init__(self, config: GenServeConfig, costs: StepCosts) -> None:
        self.config = config
        self.base_costs = costs
        self._overhead: tuple = ()
        # Kept across rounds: the same few shapes are costed every round.
        self.costs = MemoizedCosts(costs)
        self.decisions = 0
        self.last_decision: RoundDecision | None = None
        # The solver's input per request, kept while the core hands out the same view object (it
        # replaces a view whenever the request changes): most requests do not change in a round.
        self._inputs: dict[str, tuple[RequestView, str | None, ImageRequest | VideoJob]] = {}

    def schedule(self, snapshot: ClusterSnapshot) -> Decision:
        return self.decide(snapshot)

    def decide(self, snapshot: ClusterSnapshot, reserve: int = 0) -> Decision:
        """One round; `reserve` workers are worth keeping free for images expected to arrive
        (`RoundInput.reserve`: the composed policy's headroom)."""
        self._calibrate(snapshot.step_overhead_s)
        if not snapshot.sp_available:
            stranded = [v for v in snapshot.running if len(v.workers) > 1]
            if stranded:
                return Decision(_leave_sp_groups(snapshot, stranded))
        inp = round_input(snapshot, self._inputs, reserve)
        if not (inp.images or inp.videos) or not inp.workers:
            return Decision()
        config = self.config if snapshot.sp_available else _without_sp(self.config)
        decision = decide_round(inp, config, self.costs)
        self.decisions += 1
        self.last_decision = decision
        return Decision(plans_for(decision, snapshot, self.config))

    def _calibrate(self, overhead: tuple) -> None:
        # A new memo only when the router's measured overheads change (rarely: it re-publishes
        # them only when they move by more than a threshold).
        if overhead != self._overhead:
            self._overhead = overhead
            extra: Mapping[RequestKind, float] = dict(overhead)
            self.costs = MemoizedCosts(ObservedOverheadCosts(self.base_costs, extra) if extra else self.base_costs)


def _without_sp(config: GenServeConfig) -> GenServeConfig:
    """The config for rounds in which no SP group can form (the workers' world is down)."""
    return replace(config, sp_degrees=(1,), fixed_sp_degree=1, resume_degree=None)


def _leave_sp_groups(snapshot: ClusterSnapshot, stranded: list[RequestView]) -> tuple[WorkerPlan, ...]:
    """The workers' world is down (a member died): videos running on SP groups leave them for
    host memory as soon as their members are open; the next rounds resume them at degree 1.
    Nothing else is planned until none is left, so no new work lands on a group's workers."""
    plans = _Plans(snapshot)
    for view in stranded:
        if all(snapshot.worker(w).open for w in view.workers):
            plans.leave(view)
    return plans.build()


def round_input(snapshot: ClusterSnapshot,
                memo: dict[str, tuple[RequestView, str | None, ImageRequest | VideoJob]] | None = None,
                reserve: int = 0) -> RoundInput:
    """The solver's view of the snapshot. A worker whose queued work includes a video's VAE
    decode is left out of the round: the decode takes seconds, not a step, and is not the
    scheduler's to move, so counting it would let the plan hand it work that then waits.

    `memo` (kept by the caller across rounds) reuses a request's input while its view is the
    same object; entries of requests no longer in the snapshot are dropped."""
    pool = tuple(w.worker_id for w in snapshot.workers if not w.decoding)
    in_pool = set(pool)
    busy = frozenset(w.worker_id for w in snapshot.workers if w.busy and w.worker_id in in_pool)
    memo = {} if memo is None else memo
    seen: set[str] = set()
    images: list[ImageRequest] = []
    videos: list[VideoJob] = []
    video = RequestKind.T2V
    # Every request, every round (thousands at 512 workers): no property calls in the loop.
    for view in snapshot.queued + snapshot.running:
        if not view.ready:
            continue
        rid = view.request_id
        seen.add(rid)
        held = view.workers
        home = held[0] if len(held) == 1 and held[0] in in_pool else None
        is_video = view.kind is video
        cached = memo.get(rid)
        if cached is not None and cached[0] is view and cached[1] == home:
            item = cached[2]
        elif is_video:
            item = VideoJob(rid, view.shape_key.model, view.shape_key.height, view.shape_key.width,
                            view.shape_key.frames, view.steps_left, view.deadline, view.arrival_time,
                            _VIDEO_STATUS[view.status], view.workers, rows=view.rows)
        else:
            item = ImageRequest(rid, view.shape_key, view.rows, view.steps_left, view.deadline, view.arrival_time,
                                home, computed_share(view), view.controlnets, len(view.loras))
        memo[rid] = (view, home, item)
        (videos if is_video else images).append(item)
    if len(memo) > len(seen):  # (the memo holds every id seen: only then is one gone)
        for rid in [r for r in memo if r not in seen]:
            del memo[rid]
    return RoundInput(snapshot.now, pool, tuple(images), tuple(videos), busy, reserve)


class _Plans:
    """Per-worker plan parts under construction."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.snapshot = snapshot
        self.parts: dict[str, dict[str, list]] = {}
        self.leaving: set[str] = set()

    def part(self, worker_id: str, field: str) -> list:
        plan = self.parts.setdefault(worker_id, {"admit": [], "groups": [], "export": [], "release": []})
        return plan[field]

    def leave(self, view: RequestView) -> None:
        """The request's state goes to host memory: its first holder exports, the rest release."""
        if view.request_id in self.leaving:
            return
        self.leaving.add(view.request_id)
        first, *others = view.workers
        self.part(first, "export").append(view.request_id)
        for w in others:
            self.part(w, "release").append(view.request_id)

    def step(self, workers: tuple[str, ...], rid: str) -> None:
        ranks = tuple(sorted(self.snapshot.worker(w).rank for w in workers)) if len(workers) > 1 else ()
        for w in workers:
            self.part(w, "groups").append(StepGroup((rid,), ranks))

    def build(self) -> tuple[WorkerPlan, ...]:
        return tuple(
            WorkerPlan(w, admit=tuple(p["admit"]), groups=tuple(p["groups"]), export=tuple(p["export"]),
                       release=tuple(p["release"]))
            for w, p in self.parts.items() if any(p.values())
        )


def plans_for(decision: RoundDecision, snapshot: ClusterSnapshot,
              config: GenServeConfig = GenServeConfig()) -> tuple[WorkerPlan, ...]:
    """With `config.admit_busy` a busy worker's pipelined plan also admits waiting images into its
    batch, up to the room it has (no export, no move). With `config.sticky_images` a free
    worker's batch displaces every resident image it leaves out (exported: the next round
    batches it anywhere) instead of leaving it parked there, where only its own worker's batch
    could take it."""
    admit_busy = config.admit_busy
    views = {v.request_id: v for v in snapshot.queued + snapshot.running}
    workers = {w.worker_id: w for w in snapshot.workers}
    plans = _Plans(snapshot)

    def all_open(group: tuple[str, ...]) -> bool:
        return all(workers[w].open for w in group)

    def all_free(group: tuple[str, ...]) -> bool:
        return all(workers[w].open and not workers[w].busy for w in group)

    # Videos that release their workers go first: a worker still holding another video cannot
    # join a new group this round.
    owner = {w: v.request_id for v in snapshot.running if v.is_video for w in v.workers}
    starting = []
    for vd in decision.videos:
        view = views[vd.job_id]
        held = view.workers
        if vd.action is VideoAction.KEEP:
            if all_open(held):
                plans.step(held, vd.job_id)
        elif vd.action is VideoAction.PAUSE or (vd.action is VideoAction.RUN and view.status is RequestStatus.RUNNING):
            # A pause, or the first half of a move: the next round resumes it where it goes.
            if all_free(held):
                plans.leave(view)
                for w in held:
                    owner.pop(w, None)
        elif vd.action is VideoAction.RUN:
            starting.append(vd)
    taken: set[str] = set()
    for vd in starting:
        group = vd.workers
        if all_free(group) and not any(w in owner or w in taken for w in group):
            taken.update(group)
            for w in group:
                plans.part(w, "admit").append(vd.job_id)
                _make_room(plans, snapshot, views, w, keep=())
            plans.step(group, vd.job_id)

    for batch in decision.image_batches:
        w = batch.worker_id
        if not workers[w].open or w in taken or w in owner:
            continue
        free = not workers[w].busy
        stepping: list[str] = []
        admit: list[str] = []
        for rid in batch.request_ids:
            view = views[rid]
            if view.worker_id == w:
                stepping.append(rid)
            elif not free and not (admit_busy and view.status is RequestStatus.QUEUED):
                continue  # joins at the worker's boundary
            elif view.status is not RequestStatus.RUNNING:
                admit.append(rid)
                stepping.append(rid)
            elif view.worker_id is not None and all_free((view.worker_id,)):
                plans.leave(view)  # moves here in a later round
        if admit and not free:  # a pipelined plan only fills the room there is
            room = workers[w].max_batch_size - len(workers[w].running)
        elif free and config.sticky_images:
            room = _make_room(plans, snapshot, views, w, keep=tuple(stepping))
        else:
            room = max(0, _make_room(plans, snapshot, views, w, keep=tuple(stepping), need=len(admit))) if admit else 0
        if len(admit) > room:  # the rest wait for a later round
            dropped = set(admit[room:])
            admit = admit[:room]
            stepping = [rid for rid in stepping if rid not in dropped]
        if stepping:
            plans.part(w, "admit").extend(admit)
            # One group a shape: a packed batch (pack_resolutions) is several, which the
            # worker runs as one forward.
            plans.part(w, "groups").extend(group_by_shape(views[rid] for rid in stepping))
    return plans.build()


def _make_room(plans: _Plans, snapshot: ClusterSnapshot, views: dict[str, RequestView], worker_id: str,
               keep: tuple[str, ...], need: int | None = None) -> int:
    """Export images resident on the worker that do not step here this round (newest first):
    enough to admit `need` more, or all of them when `need` is None (a video takes the worker).
    Returns how many requests the worker can admit afterwards."""
    worker: WorkerView = snapshot.worker(worker_id)
    staying = [rid for rid in worker.running if rid not in plans.leaving]
    idle = [rid for rid in staying if rid not in keep and not views[rid].is_video]
    room = worker.max_batch_size - len(staying)
    count = len(idle) if need is None else min(len(idle), max(0, need - room))
    for rid in idle[len(idle) - count:]:
        plans.leave(views[rid])
    return room + count
