"""What one GenServe scheduling round sees and decides (GenServe §4.4, Table 4 notation).

Frozen dataclasses, validated on construction, so the router and the simulator can build them
and a malformed round fails where it is built rather than deep inside the solver. Nothing here
knows about Ray, torch or the wall clock: `now` is a field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from stepserve.policies.types import ShapeKey


def _positive_int(owner: str, name: str, value: object) -> None:
    # bool is an int subclass; `True` as a size is a typo, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _real(owner: str, name: str, value: object, allow_inf: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if not allow_inf and math.isinf(value):
        raise ValueError(f"{owner}.{name} must be finite, got {value!r}")


@dataclass(frozen=True)
class ImageRequest:
    """One queued or resident text-to-image request (r in R_I)."""

    request_id: str
    shape_key: ShapeKey  # requests batch only with equal keys (same model and resolution, one frame)
    rows: int  # batch rows this request adds: 2 with classifier-free guidance, 1 without
    steps_left: int
    deadline: float  # D_r, absolute; +inf means no SLO
    arrival_time: float  # A_r
    worker_id: str | None = None  # where its latents live when resident, else None
    # The share of its tokens a forward computes (`cost_model.computed_share`): below 1 for an
    # edit of a cached template (InstGenIE), which its batch's step is priced at.
    computed_share: float = 1.0
    # Its add-ons, which its batch's step is priced with (SwiftDiffusion): the ControlNets it is
    # conditioned on (each once) and how many LoRAs it applies.
    controlnets: tuple[str, ...] = ()
    loras: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.computed_share <= 1.0:
            raise ValueError(f"ImageRequest.computed_share must be in [0, 1], got {self.computed_share!r}")
        if self.shape_key.frames != 1:
            # More frames make a video, planned as a VideoJob; costs tell the two apart by frames.
            raise ValueError(f"image {self.request_id!r}: an image has one frame, got {self.shape_key.frames}")
        _positive_int("ImageRequest", "rows", self.rows)
        _positive_int("ImageRequest", "steps_left", self.steps_left)
        if isinstance(self.loras, bool) or not isinstance(self.loras, int) or self.loras < 0:
            raise ValueError(f"ImageRequest.loras must be an int >= 0, got {self.loras!r}")
        _real("ImageRequest", "deadline", self.deadline, allow_inf=True)
        _real("ImageRequest", "arrival_time", self.arrival_time, allow_inf=False)


class VideoStatus(str, Enum):
    QUEUED = "queued"  # never ran
    RUNNING = "running"  # holds an SP group of workers
    PAUSED = "paused"  # preempted at a step boundary; its state waits off the workers


@dataclass(frozen=True)
class VideoJob:
    """One text-to-video job (v in R_V). A running job's SP degree is `len(workers)`."""

    job_id: str
    model: str
    height: int
    width: int
    frames: int
    steps_left: int  # S_v^rem
    deadline: float  # D_v, absolute; +inf means no SLO
    arrival_time: float
    status: VideoStatus
    workers: tuple[str, ...] = ()  # X_v(t): its SP group while running, else empty
    rows: int = 2  # batch rows of its forward: 2 with classifier-free guidance (Wan's default), 1 without

    def __post_init__(self) -> None:
        for name in ("height", "width", "frames", "steps_left", "rows"):
            _positive_int("VideoJob", name, getattr(self, name))
        _real("VideoJob", "deadline", self.deadline, allow_inf=True)
        _real("VideoJob", "arrival_time", self.arrival_time, allow_inf=False)
        if not isinstance(self.status, VideoStatus):
            raise ValueError(f"VideoJob.status must be a VideoStatus, got {self.status!r}")
        if (self.status is VideoStatus.RUNNING) != bool(self.workers):
            raise ValueError(f"video {self.job_id!r}: a running job has workers and only a running job has them")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"video {self.job_id!r}: repeated worker in {self.workers}")

    @property
    def degree(self) -> int:
        return len(self.workers)

    @property
    def running(self) -> bool:
        return self.status is VideoStatus.RUNNING


@dataclass(frozen=True)
class GenServeConfig:
    """Knobs of the per-round scheduler; the three switches are the paper's ablation (Fig. 14)."""

    sp_degrees: tuple[int, ...] = (1, 2, 4, 8)  # P: SP degrees a video may run at
    image_max_batch: int = 8  # images per batch (requests, not rows)
    # Delta_round in seconds: how long a request left out of this round waits at least before the
    # next decision can start it. It prices pausing and queueing (the "recoverable" test).
    round_s: float = 1.0
    preemption: bool = True  # off: a running video is never paused
    dp: bool = True  # off: greedy first-come-first-served allocation instead of the knapsack DP
    elastic_sp: bool = True  # off: a running video keeps its degree; a new one gets fixed_sp_degree
    fixed_sp_degree: int = 1  # the degree a video starts or resumes at when elastic_sp is off
    # The degree a waiting video is assumed to get when it resumes, when judging whether it can
    # still meet its deadline. None: the fastest allowed degree that fits the cluster (the
    # paper's optimistic "recoverable"); a smaller value resumes videos earlier.
    resume_degree: int | None = None
    # Off (as published): images are batched by deadline across the pool, and a batch's members
    # resident elsewhere move to it. On: a resident image is batched only with its own worker's
    # (waiting images go anywhere), so no image moves to form a batch (the composed policy's).
    sticky_images: bool = False
    # Off (as published): a worker inside a step (its next plan pipelined behind the current one)
    # only continues; admissions wait for its boundary, which under a pipelining router only
    # comes once its batch has drained. On: its next plan also admits waiting images into the
    # room its batch has (the composed policy's; moves and pauses still wait).
    admit_busy: bool = False
    # Off (as published): a batch holds images of one shape. On: images of one model and several
    # resolutions share a batch, run as one packed forward (PatchedServe §4) and priced as the
    # cost model prices it; only for models it packs (`workers.pack_resolutions`, whose router
    # prices packed forwards: `MemoizedCosts.packs`).
    pack_resolutions: bool = False
    # Off (as published): an image joins the first batch it keeps on time (EDF batching saves
    # workers for videos). On: while empty free workers are left (none busy, no resident, no
    # video, one kept back for each waiting video), a waiting image opens a batch of its own
    # there, and joins batches only once none is; an image without an SLO then joins the batch
    # it steps fastest in (the least loaded: with no deadline, the first batch would take every
    # one) of those holding at most a worker's share of the images' work, present and expected
    # (`image_batching._fair_share`: at the end of a burst the last images spread over the
    # workers freeing up). Off, an image batched up to its deadline on
    # an idle pool waited 3x its solo latency (P95, SDXL at 3 req/s: 10.9 s against 5.2 s), and
    # edits without SLOs piled onto one worker (P95 2.2x JSQ's).
    spread_images: bool = False

    def __post_init__(self) -> None:
        degrees = self.sp_degrees
        if not isinstance(degrees, tuple) or not degrees:
            raise ValueError(f"sp_degrees must be a non-empty tuple, got {degrees!r}")
        for d in degrees:
            _positive_int("GenServeConfig", "sp_degrees[]", d)
        if list(degrees) != sorted(set(degrees)):
            raise ValueError(f"sp_degrees must be strictly increasing, got {degrees!r}")
        _positive_int("GenServeConfig", "image_max_batch", self.image_max_batch)
        _real("GenServeConfig", "round_s", self.round_s, allow_inf=False)
        if self.round_s < 0:
            raise ValueError(f"round_s must be >= 0, got {self.round_s!r}")
        if self.fixed_sp_degree not in degrees:
            raise ValueError(f"fixed_sp_degree {self.fixed_sp_degree!r} is not in sp_degrees {degrees}")
        if self.resume_degree is not None and self.resume_degree not in degrees:
            raise ValueError(f"resume_degree {self.resume_degree!r} is not in sp_degrees {degrees}")


@dataclass(frozen=True)
class RoundInput:
    """The global snapshot one round is solved on."""

    now: float
    workers: tuple[str, ...]  # G; order is the topology order new SP groups are cut from
    images: tuple[ImageRequest, ...] = ()  # I(t): queued and resident
    videos: tuple[VideoJob, ...] = ()  # V(t): queued, paused and running
    # Workers still inside a step when the round is decided (an event-driven caller decides at
    # every boundary, while other workers are mid-step). The solver treats every worker alike
    # (a busy one joins the plan at its boundary, within one step), but new work is placed on
    # free workers first, so a free worker is not left idle while an urgent image waits for a
    # busy one (materialize.py).
    busy: frozenset[str] = frozenset()
    # Workers worth keeping free for images expected before the next boundaries (the composed
    # policy's headroom; GenServe itself keeps none): each is scored as RESERVE_WEIGHT.
    reserve: int = 0

    def __post_init__(self) -> None:
        _real("RoundInput", "now", self.now, allow_inf=False)
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, int) or self.reserve < 0:
            raise ValueError(f"RoundInput.reserve must be an int >= 0, got {self.reserve!r}")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"repeated worker id in {self.workers}")
        known = set(self.workers)
        if not isinstance(self.busy, frozenset) or not self.busy <= known:
            raise ValueError(f"busy must be a frozenset of known workers, got {self.busy!r}")
        ids = [i.request_id for i in self.images] + [v.job_id for v in self.videos]
        if len(set(ids)) != len(ids):
            raise ValueError("image and video ids must be unique within a round")
        owner: dict[str, str] = {}
        for video in self.videos:
            for w in video.workers:
                if w not in known:
                    raise ValueError(f"video {video.job_id!r} runs on unknown worker {w!r}")
                if w in owner:
                    raise ValueError(f"worker {w!r} is in the SP groups of both {owner[w]!r} and {video.job_id!r}")
                owner[w] = video.job_id
        for image in self.images:
            if image.worker_id is not None and image.worker_id not in known:
                raise ValueError(f"image {image.request_id!r} is resident on unknown worker {image.worker_id!r}")


class VideoAction(str, Enum):
    KEEP = "keep"  # running on exactly its current workers: nothing to do
    RUN = "run"  # step on `workers` this round: start, resume, or regroup at a new degree
    PAUSE = "pause"  # was running, stops at the step boundary (preempted)
    WAIT = "wait"  # was queued or paused and stays so


@dataclass(frozen=True)
class VideoDecision:
    job_id: str
    action: VideoAction
    workers: tuple[str, ...] = ()  # the SP group for KEEP and RUN
    predicted_finish: float | None = None  # end of denoising if the group is kept; None when not running

    @property
    def degree(self) -> int:
        return len(self.workers)


@dataclass(frozen=True)
class ImageBatch:
    """One worker's image work this round: one forward of same-shape requests."""

    worker_id: str
    shape_key: ShapeKey
    request_ids: tuple[str, ...]  # earliest deadline first
    admit: tuple[str, ...]  # members not yet resident on this worker (new, or moved here)
    step_s: float  # predicted seconds per step of this batch


@dataclass(frozen=True, order=True)
class PlanScore:
    """The objective, compared lexicographically (see scoring.py for why these three keys).

    Integers, so sums do not depend on the order they are added in and the DP and a brute-force
    oracle agree exactly.
    """

    met: int  # requests predicted to meet their deadline (z_r summed)
    urgency: int  # slack weights of the requests that step this round
    neg_weighted_remaining: int  # minus the slack-weighted predicted remaining time

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.met, self.urgency, self.neg_weighted_remaining)


@dataclass(frozen=True)
class RoundDecision:
    """Pi*: the allocation for one round."""

    now: float
    videos: tuple[VideoDecision, ...]  # one per input video, in input order
    image_batches: tuple[ImageBatch, ...]  # at most one per worker, in worker order
    score: PlanScore
    preempted: tuple[str, ...] = ()  # running videos paused this round, most slack first
    downgraded: tuple[str, ...] = ()  # running videos moved to a smaller SP degree
    idle_workers: tuple[str, ...] = ()
    waiting_images: tuple[str, ...] = ()  # images that do not step this round, in input order

    def video(self, job_id: str) -> VideoDecision:
        for decision in self.videos:
            if decision.job_id == job_id:
                return decision
        raise KeyError(job_id)

    def batch_on(self, worker_id: str) -> ImageBatch | None:
        for batch in self.image_batches:
            if batch.worker_id == worker_id:
                return batch
        return None

    @property
    def stepping_images(self) -> tuple[str, ...]:
        return tuple(rid for batch in self.image_batches for rid in batch.request_ids)
