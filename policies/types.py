"""Values that cross layers: the one request model, what schedulers see, and what they decide.

Pure Python, frozen dataclasses. The ingress turns validated HTTP/handle input into a
`RequestSpec`; the router core keeps mutable state of its own and hands schedulers read-only
`ClusterSnapshot`s; a scheduler answers with a `Decision` (one `WorkerPlan` per worker it
plans for); a worker answers each plan with a `StepReport`. The simulator builds the same
snapshots and reads the same reports, so nothing here may know about Ray, torch or the clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property


class RequestKind(str, Enum):
    T2I = "t2i"  # text to image
    EDIT = "edit"  # masked image editing: repaint the masked part of an image (inpainting)

    @property
    def lane(self) -> "RequestKind":
        """The kind whose queue limits, admission and load counts it shares: edits are images."""
        return RequestKind.T2I if self is RequestKind.EDIT else self
    T2V = "t2v"  # text to video


class LoraBatching(str, Enum):
    MIXED = "mixed"  # a forward batches requests with different LoRAs (per-request unmerged updates)
    PER_ADAPTER = "per_adapter"  # a forward takes requests with one LoRA set only


class StepCacheMethod(str, Enum):
    """What a step a request's step cache skips takes (`engine.step_cache`)."""

    FIRST_BLOCK = "first_block"  # the later blocks' result at its last computed step, as it was
    TAYLORSEER = "taylorseer"  # that result extrapolated to first order from its last two computed steps


@dataclass(frozen=True, order=True)
class ShapeKey:
    """Requests with equal keys can share one denoiser forward (rows are independent)."""

    model: str
    height: int
    width: int
    frames: int = 1
    # The LoRAs and scales every member applies, where a forward takes one adapter set (the
    # router core's `lora_batches` "per_adapter": one adapter per batch, as vLLM-Omni and SGLang
    # serve); () where a forward mixes requests with different LoRAs (stepserve's default).
    loras: tuple[tuple[str, float], ...] = ()
    # Edits that reuse their templates' cached activations (a masked forward): they batch only
    # with each other (`CoreConfig.cached_edits`).
    cached_edit: bool = False


@dataclass(frozen=True)
class ControlNetUse:
    """One ControlNet a request is conditioned on (its control image travels with the request's
    conditioning, not here: specs stay small). As the diffusers ControlNet pipelines'
    `controlnet_conditioning_scale`, `control_guidance_start` and `control_guidance_end`."""

    name: str
    conditioning_scale: float = 1.0
    start: float = 0.0  # fraction of the steps before which it is off
    end: float = 1.0  # fraction of the steps after which it is off

    def __post_init__(self) -> None:
        if not 0.0 <= self.start < self.end <= 1.0:
            raise ValueError(f"ControlNet {self.name!r}: need 0 <= start < end <= 1, got {self.start}, {self.end}")

    def scale_at(self, step: int, steps_total: int) -> float:
        """Its residuals' scale at step `step` of `steps_total`: the pipelines' `controlnet_keep`
        times `conditioning_scale`, computed as they compute it (so the floats are the same)."""
        keep = 1.0 - float(step / steps_total < self.start or (step + 1) / steps_total > self.end)
        return self.conditioning_scale * keep


@dataclass(frozen=True)
class LoraUse:
    """One LoRA a request is styled with, at `scale` (diffusers' adapter weight: the update
    `scale * alpha / rank * B @ A` is added to each layer it targets)."""

    name: str
    scale: float = 1.0



def first_skipping_step(fraction: float, steps: int) -> int | None:
    """The first step of `steps` that skips CFG when skipping starts at `fraction` of them
    (rounded up), or None when none is left to skip (fraction 1 included)."""
    # f * steps is computed in floats: 0.7 of 10 steps must be step 7, not ceil(7.000000000000001) = 8.
    first = max(0, math.ceil(fraction * steps - 1e-9))
    return first if first < steps else None


@dataclass(frozen=True)
class RequestSpec:
    """One image or video to generate. Immutable once the ingress has validated it.

    An image is a one-frame request; `fps` is the frame rate of a video's file. `slo_s` is the
    latency objective from arrival (None: best effort).
    """

    request_id: str
    model: str
    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str = ""
    kind: RequestKind = RequestKind.T2I
    num_frames: int = 1
    fps: int = 16
    slo_s: float | None = None
    # Whether the model guides by classifier-free guidance (a second, unconditional row under
    # `guidance_scale` > 1). Guidance-distilled models (Flux) take the scale as an input of one
    # row instead: the ingress sets this from the family (`DiffusionFamily.classifier_free_guidance`).
    cfg: bool = True
    # Add-ons, in the order the request names them (ControlNet residuals are summed in it).
    controlnets: tuple[ControlNetUse, ...] = ()
    loras: tuple[LoraUse, ...] = ()
    # An edit's image and mask travel with its conditioning (as control images do); the spec
    # keeps what schedulers and costs need. `strength`: how far into the noise the image goes
    # (the inpaint pipelines' `strength`); `skip_steps`: the first of the `num_inference_steps`
    # timesteps it therefore skips, as its family's pipeline rounds them
    # (`DiffusionFamily.skipped_steps`; the ingress sets it). `mask_ratio`: the fraction of the
    # latent grid the mask covers (1 for generations). `template_id`: the image as a reusable
    # template, whose cached activations an edit may reuse.
    strength: float = 1.0
    skip_steps: int = 0
    mask_ratio: float = 1.0
    template_id: str | None = None
    # Its First-Block Cache threshold (`engine.step_cache`): a step whose first-block output moved
    # less than this since its last computed step reuses that step's later blocks. 0: off, exact.
    step_cache: float = 0.0
    step_cache_method: StepCacheMethod = StepCacheMethod.FIRST_BLOCK
    # SynerDiff's adaptive skip-CFG (`engine.forward_modes.skip_cfg`): from this fraction of its
    # steps on it runs without its unconditional row (the ingress reads it off its model's
    # measured curve for the model's quality threshold). 1: never, exact.
    skip_cfg_from: float = 1.0
    # The earliest it may start under load: at its model's quality floor (`min_skip_cfg_quality`).
    # A worker's load controller (SynerDiff §III-D) moves its start between the two as its queue
    # builds and falls. None: `skip_cfg_from` (nothing moves it; exact requests stay exact).
    skip_cfg_floor_from: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RequestKind):
            raise ValueError(f"request {self.request_id!r}: kind must be a RequestKind, got {self.kind!r}")
        if self.kind is not RequestKind.T2V and self.num_frames != 1:
            raise ValueError(f"request {self.request_id!r}: an image has one frame, got {self.num_frames}")
        if not (0.0 < self.strength <= 1.0 and 0.0 <= self.mask_ratio <= 1.0):
            raise ValueError(f"request {self.request_id!r}: need 0 < strength <= 1 and 0 <= mask_ratio <= 1, "
                             f"got {self.strength}, {self.mask_ratio}")
        if self.kind is not RequestKind.EDIT and (self.strength != 1.0 or self.skip_steps or self.mask_ratio != 1.0
                                                  or self.template_id):
            raise ValueError(f"request {self.request_id!r}: strength, skip_steps, mask_ratio and template_id are "
                             "for edits")
        if self.num_frames < 1 or self.num_inference_steps < 1:
            raise ValueError(f"request {self.request_id!r}: num_frames and num_inference_steps must be >= 1")
        if self.slo_s is not None and not self.slo_s > 0:
            raise ValueError(f"request {self.request_id!r}: slo_s must be > 0 or None, got {self.slo_s!r}")
        names = [use.name for use in self.loras]
        if len(set(names)) != len(names):  # (one ControlNet twice, with two images, is fine)
            raise ValueError(f"request {self.request_id!r}: a LoRA is named twice in {names}")
        if not isinstance(self.step_cache_method, StepCacheMethod):
            raise ValueError(f"request {self.request_id!r}: step_cache_method must be a StepCacheMethod, "
                             f"got {self.step_cache_method!r}")
        if not 0.0 <= self.skip_cfg_from <= 1.0:
            raise ValueError(f"request {self.request_id!r}: skip_cfg_from must be a fraction in [0, 1], "
                             f"got {self.skip_cfg_from!r}")
        if self.skip_cfg_floor_from is not None and not 0.0 <= self.skip_cfg_floor_from <= self.skip_cfg_from:
            raise ValueError(f"request {self.request_id!r}: skip_cfg_floor_from must be in [0, skip_cfg_from "
                             f"{self.skip_cfg_from!r}], got {self.skip_cfg_floor_from!r}")
        if not 0.0 <= self.step_cache < float("inf"):
            raise ValueError(f"request {self.request_id!r}: step_cache must be a finite threshold >= 0, "
                             f"got {self.step_cache!r}")
        if not 0 <= self.skip_steps < self.num_inference_steps:
            raise ValueError(f"request {self.request_id!r}: skip_steps must leave at least one of its "
                             f"{self.num_inference_steps} steps, got {self.skip_steps}")

    @property
    def steps_to_run(self) -> int:
        """The denoising steps it runs: all `num_inference_steps` but the ones an edit skips."""
        return self.num_inference_steps - self.skip_steps

    @property
    def uses_cfg(self) -> bool:
        # Same rule as diffusers' `do_classifier_free_guidance` (SD, SD3 and Wan pipelines alike).
        return self.cfg and self.guidance_scale > 1.0

    @property
    def rows(self) -> int:
        """Batch rows this request adds to a forward: [uncond, cond] under CFG."""
        return 2 if self.uses_cfg else 1

    @property
    def skip_cfg_step(self) -> int | None:
        """The first of its steps that runs without its unconditional row (`skip_cfg_from` of its
        steps, rounded up), or None: it never skips (no CFG, or no step left to skip)."""
        return self.skip_cfg_step_under(0.0)

    def skip_cfg_step_under(self, load: float) -> int | None:
        """`skip_cfg_step` when its worker's load controller has moved `load` (0: not at all, 1: all
        the way) of the way from its own start to its floor's."""
        floor = self.skip_cfg_from if self.skip_cfg_floor_from is None else self.skip_cfg_floor_from
        fraction = self.skip_cfg_from - load * (self.skip_cfg_from - floor)
        return first_skipping_step(fraction, self.steps_to_run) if self.uses_cfg else None

    @property
    def is_video(self) -> bool:
        return self.kind is RequestKind.T2V

    @property
    def is_edit(self) -> bool:
        return self.kind is RequestKind.EDIT

    @property
    def shape_key(self) -> ShapeKey:
        return ShapeKey(self.model, self.height, self.width, self.num_frames)

    def batch_key(self, per_adapter: bool, cached_edits: bool = False) -> ShapeKey:
        """Its shape key, with its LoRA set when each forward takes one adapter set, and marked
        when it is an edit of a template that reuses cached activations."""
        key = self.shape_key
        loras = tuple(sorted((use.name, use.scale) for use in self.loras)) if per_adapter else ()
        cached = cached_edits and self.is_edit and self.template_id is not None
        if loras or cached:
            key = ShapeKey(key.model, key.height, key.width, key.frames, loras, cached)
        return key


class RequestStatus(str, Enum):
    QUEUED = "queued"  # never ran (or lost its state with a worker and starts over)
    RUNNING = "running"  # its state is on a worker (an SP group for a video)
    PAUSED = "paused"  # its state waits in host memory (preempted, moving, or resuming after a fault)
    DECODING = "decoding"  # denoised; its output is being decoded, encoded or stored
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass(frozen=True)
class RequestView:
    """What a scheduler may know about one request that still needs denoising steps.

    Steps count the plans already sent (pipelined plans included): a scheduler plans from where
    the request will be once those have run.
    """

    request_id: str
    kind: RequestKind
    shape_key: ShapeKey
    rows: int
    steps_done: int
    steps_total: int
    arrival_time: float
    deadline: float  # absolute, for the end of denoising (the SLO minus the decode tail); inf: none
    ready: bool  # conditioning (text embeddings) is available, so a worker can admit it
    status: RequestStatus  # QUEUED or PAUSED while waiting; RUNNING on `workers`
    workers: tuple[str, ...] = ()  # where its state is while running
    loras: tuple[str, ...] = ()  # the LoRAs it applies (of its model)
    mask_ratio: float = 1.0  # an edit's masked fraction (`RequestSpec.mask_ratio`)
    template_id: str | None = None  # an edit's template (`RequestSpec.template_id`)
    # The ControlNets it is conditioned on, each once (a forward makes one call per ControlNet
    # over the rows of the members that use it: `BatchShape.controlnet_rows`).
    controlnets: tuple[str, ...] = ()

    @property
    def steps_left(self) -> int:
        return self.steps_total - self.steps_done

    @property
    def uses_cfg(self) -> bool:
        return self.rows == 2

    @property
    def is_video(self) -> bool:
        return self.kind is RequestKind.T2V

    @property
    def worker_id(self) -> str | None:
        """The one worker holding it, or None (waiting, or spread over an SP group)."""
        return self.workers[0] if len(self.workers) == 1 else None


@dataclass(frozen=True)
class WorkerView:
    """What a scheduler may know about one live denoiser worker (dead ones are left out)."""

    worker_id: str
    rank: int  # its rank in the workers' process-group world (StepGroup.ranks)
    max_batch_size: int  # requests that may be resident on it at once
    running: tuple[str, ...]  # resident request ids, in admission order
    open: bool = True  # it may take a plan now (room in its pipeline; its current work ends soon)
    busy: bool = False  # a plan is executing or queued on it (open and busy: its next plan is pipelined)
    decoding: bool = False  # its queued work includes a video's VAE decode (seconds, not a step)
    loras: frozenset[tuple[str, str]] = frozenset()  # (model, LoRA) it holds in its device memory


@dataclass(frozen=True)
class SnapshotIndex:
    """A snapshot's workers and running requests as lookups. The router core keeps them up to
    date as things change and lends them to the round's snapshot, so a round costs what changed,
    not a walk over the pool (building every worker's tuples each round would). Being lent, they
    are valid only until the core changes again: `current()` says whether they still are, and a
    snapshot refuses to read them once they are not (a scheduler must not keep a snapshot)."""

    workers_by_id: Mapping[str, WorkerView]  # live workers, rank order
    running_by_worker: Mapping[str, tuple[RequestView, ...]]  # every holder (all SP members)
    # Open workers holding requests, and holding nothing: each in the order they last changed
    # (deterministic; keeping rank order would cost a sort per round).
    open_ids: tuple[str, ...]
    open_idle_ids: tuple[str, ...]
    # Live workers by (max_batch_size, residents): what join-shortest-queue needs.
    load_counts: Mapping[tuple[int, int], int]
    current: Callable[[], bool] = field(default=lambda: True, compare=False)

    @classmethod
    def of(cls, workers: tuple[WorkerView, ...], running: tuple[RequestView, ...]) -> "SnapshotIndex":
        """An index owning its tables, from the snapshot's contents."""
        by_worker: dict[str, list[RequestView]] = {}
        for view in running:
            for w in view.workers:
                by_worker.setdefault(w, []).append(view)
        counts: dict[tuple[int, int], int] = {}
        for w in workers:
            key = (w.max_batch_size, len(w.running))
            counts[key] = counts.get(key, 0) + 1
        return cls({w.worker_id: w for w in workers}, {w: tuple(v) for w, v in by_worker.items()},
                   tuple(w.worker_id for w in workers if w.open and w.running),
                   tuple(w.worker_id for w in workers if w.open and not w.running), counts)


@dataclass(frozen=True, eq=False)
class ClusterSnapshot:
    """What a scheduler sees in one round. `workers` (live, rank order) and `running` (worker by
    worker, admission order; an SP group's request once) are derived from `index` when first
    read; build a snapshot from plain tuples with `ClusterSnapshot.of`."""

    now: float
    queued: tuple[RequestView, ...]  # waiting to run (QUEUED or PAUSED), in arrival order
    index: SnapshotIndex
    sp_available: bool = True  # sequence-parallel groups can form (the workers' world is up)
    # What a step costs beyond its profile, as the router measures it, by request kind:
    # schedulers that predict step times add it (see policies/genserve/costs.py).
    step_overhead_s: tuple[tuple[RequestKind, float], ...] = ()

    @classmethod
    def of(cls, now: float, queued: tuple[RequestView, ...], running: tuple[RequestView, ...],
           workers: tuple[WorkerView, ...], sp_available: bool = True,
           step_overhead_s: tuple[tuple[RequestKind, float], ...] = ()) -> "ClusterSnapshot":
        return cls(now, tuple(queued), SnapshotIndex.of(tuple(workers), tuple(running)), sp_available,
                   step_overhead_s)

    def lookups(self) -> SnapshotIndex:
        """The index, checked to be still current."""
        if not self.index.current():
            raise RuntimeError("this snapshot's round is over: the router core has changed since")
        return self.index

    @cached_property
    def workers(self) -> tuple[WorkerView, ...]:
        return tuple(self.lookups().workers_by_id.values())

    @cached_property
    def running(self) -> tuple[RequestView, ...]:
        out: dict[str, RequestView] = {}
        for views in self.lookups().running_by_worker.values():
            for view in views:
                out.setdefault(view.request_id, view)
        return tuple(out.values())

    def worker(self, worker_id: str) -> WorkerView:
        try:
            return self.lookups().workers_by_id[worker_id]
        except KeyError:
            raise KeyError(worker_id) from None

    def running_on(self, worker_id: str) -> tuple[RequestView, ...]:
        return self.lookups().running_by_worker.get(worker_id, ())

    def open_workers(self, idle: bool = True) -> tuple[WorkerView, ...]:
        """Open workers holding requests, then (with `idle`) open workers holding nothing."""
        by_id = self.lookups().workers_by_id
        ids = self.index.open_ids + self.index.open_idle_ids if idle else self.index.open_ids
        return tuple(by_id[w] for w in ids)

    def least_load_with_room(self, cap: int | None, excluding: str) -> int | None:
        """The fewest residents on a live worker other than `excluding` that has room under
        min(cap, its batch size); None when no such worker."""
        me = self.worker(excluding)
        mine = (me.max_batch_size, len(me.running))
        best = None
        for (size, load), count in self.lookups().load_counts.items():
            if (size, load) == mine:
                count -= 1
            limit = size if cap is None else min(cap, size)
            if count > 0 and load < limit and (best is None or load < best):
                best = load
        return best

    def overhead_s(self, kind: RequestKind) -> float:
        return dict(self.step_overhead_s).get(kind, 0.0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSnapshot):
            return NotImplemented
        return (self.now, self.queued, self.running, self.workers, self.sp_available, self.step_overhead_s) == (
            other.now, other.queued, other.running, other.workers, other.sp_available, other.step_overhead_s)


class GroupSplit(str, Enum):
    """How a group's forward is split over its ranks."""

    SEQUENCE = "sequence"  # the video's tokens (Ulysses sequence parallelism)
    CFG = "cfg"  # the request's two CFG rows, one a rank (SwiftDiffusion's latent parallelism)


@dataclass(frozen=True)
class StepGroup:
    """Requests that share one denoiser forward. With `ranks`, the forward is split over the
    workers of those world ranks as `split` says: every one of them has the same group in its
    plan of the same round, and the group holds one request."""

    request_ids: tuple[str, ...]
    ranks: tuple[int, ...] = ()  # sorted world ranks; () runs on this worker alone
    split: GroupSplit = GroupSplit.SEQUENCE  # with ranks: what each rank computes


@dataclass(frozen=True)
class WorkerPlan:
    """One round for one worker. It runs, in order: `drop` (forget), `admit` (start fresh, or
    resume from host memory), one forward per group (every member advances one step) `steps`
    times over, then `export`, `checkpoint` and `finish`, whose data it returns, and last
    `release` (forget).

    Schedulers fill `admit`, `groups`, `export` (state to host memory; the request leaves:
    pause, or the first half of a move) and `release` (the other members of an SP group whose
    first member exports). The router fills the rest: `drop` (cancelled or failed), `checkpoint`
    (a copy of the state to host memory, so a worker fault loses little), `finish` (this round
    ends the request's denoising: an image returns its latents, a video is decoded here and
    returns its frames; the other members of its SP group `release` it), `steps` (a steady
    policy's batch runs several steps per plan while nothing would change its plan: see
    `CoreConfig.max_plan_s`; the router may cut such a plan short between two steps, and the
    report says how many ran), `plan_id` (its position in the worker's sequence) and `queued`
    (the requests waiting for a worker as it made the plan: the queue whose trend SynerDiff's load
    controller on a worker follows).
    """

    worker_id: str
    admit: tuple[str, ...] = ()
    groups: tuple[StepGroup, ...] = ()
    export: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    checkpoint: tuple[str, ...] = ()
    finish: tuple[str, ...] = ()
    steps: int = 1
    plan_id: int = 0
    queued: int = 0

    @property
    def stepping(self) -> tuple[str, ...]:
        return tuple(rid for group in self.groups for rid in group.request_ids)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The ids whose data the worker returns after its report, in this order."""
        return self.export + self.checkpoint + self.finish

    @property
    def is_empty(self) -> bool:
        return not (self.admit or self.groups or self.export or self.release or self.drop or self.checkpoint
                    or self.finish)


@dataclass(frozen=True)
class Decision:
    """A scheduler's answer: at most one plan per open worker. `wake_at`: a policy that holds
    work back on purpose (a batching window) asks to be called again then, even if nothing else
    happens. `discard`: waiting requests the policy gives up this round because they cannot meet
    their deadlines under the present load (PatchedServe's Algorithm 1: not even if run now), each
    with the reason, which their callers are told; the router fails them before it sends any plan
    (a late image is worth nothing to its client, and the work it would take delays the others).
    A discarded request is in no plan of the same decision."""

    plans: tuple[WorkerPlan, ...] = ()
    wake_at: float | None = None
    discard: tuple[RequestFailure, ...] = ()

    def __post_init__(self) -> None:
        if self.wake_at is not None and not math.isfinite(self.wake_at):
            raise ValueError(f"wake_at must be finite or None, got {self.wake_at!r}")
        if not isinstance(self.discard, tuple):
            raise ValueError(f"discard must be a tuple of RequestFailures, got {type(self.discard).__name__}")
        seen: set[str] = set()
        for failure in self.discard:
            if not isinstance(failure, RequestFailure) or not isinstance(failure.request_id, str):
                raise ValueError(f"discard holds RequestFailures with string request ids, got {failure!r}")
            if failure.lost:
                raise ValueError(f"discarded {failure.request_id!r} is marked lost: a policy gives requests up, "
                                 "it does not lose their state")
            if failure.request_id in seen:
                raise ValueError(f"{failure.request_id!r} is discarded twice")
            seen.add(failure.request_id)


@dataclass(frozen=True)
class RequestProgress:
    request_id: str
    steps_done: int
    steps_total: int


@dataclass(frozen=True)
class RequestFailure:
    """A request the worker could not serve this round. `lost`: its state or an input was lost
    to a fault elsewhere (a worker or its SP partner died); the router resumes it from its last
    checkpoint instead of failing it."""

    request_id: str
    message: str
    lost: bool = False


@dataclass(frozen=True)
class EditBlockCounts:
    """What a worker's masked forwards of template edits did (InstGenIE §4.2's loading DP): cache
    slots that used their cached activations, blocks that computed every token instead, and
    forwards whose choice had no measured block costs (they loaded every slot)."""

    loaded: int = 0
    computed: int = 0
    unplanned: int = 0


@dataclass(frozen=True)
class StepReport:
    """A worker's answer to a `WorkerPlan`. `incarnation` changes when the worker restarts, so a
    router can tell a fresh worker (which lost every resident request) from the one it knew.

    `steps_run` is set only when the router cut the plan short (an interrupt between two of its
    steps): it ran that many of its `steps`, and whatever it was to finish is still resident,
    not denoised to the end."""

    worker_id: str
    plan_id: int
    progress: tuple[RequestProgress, ...] = ()  # every request that stepped or was admitted
    failed: tuple[RequestFailure, ...] = ()
    duration_s: float = 0.0  # time spent executing the plan
    batch_size: int = 0  # requests that stepped this round
    incarnation: str = ""
    steps_run: int | None = None  # None: all of the plan's steps
    # Seconds the worker sat between its previous plan and this one while requests were resident
    # on it (the hand-off: the report's trip, the router's round, this plan's trip); None when it
    # held none (then waiting delayed no one).
    waited_s: float | None = None
    # Seconds of the plan spent bringing LoRAs to the worker (waiting for the store, adding
    # them): time every request of the batch waited for them.
    lora_wait_s: float = 0.0
    edit_blocks: EditBlockCounts = EditBlockCounts()  # the plan's masked forwards, block by block
    # Its SynerDiff load controller after this plan's queue sample (`WorkerPlan.queued`): how far
    # it has moved skip-CFG starts toward their floors (0 to 1), and the chunks of a decode that
    # starts now. None: the worker runs no load controller.
    load_control: tuple[float, int] | None = None
