"""Values that cross layers: the request spec, what policies see, and what they decide.

Pure Python, frozen dataclasses. The ingress turns validated HTTP/handle input into a
`RequestSpec`; the router keeps mutable state of its own and hands policies read-only
`ClusterSnapshot`s; a policy answers with a `WorkerPlan`; a worker answers with a `StepReport`.
The simulator builds the same snapshots and reads the same reports, so nothing here may know
about Ray, torch or the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, order=True)
class ShapeKey:
    """Requests with equal keys can share one denoiser forward (rows are independent)."""

    model: str
    height: int
    width: int


@dataclass(frozen=True)
class RequestSpec:
    """One image to generate. Immutable once the ingress has validated it."""

    request_id: str
    model: str
    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str = ""
    kind: str = "t2i"

    @property
    def uses_cfg(self) -> bool:
        # Same rule as diffusers' `do_classifier_free_guidance`.
        return self.guidance_scale > 1.0

    @property
    def shape_key(self) -> ShapeKey:
        return ShapeKey(self.model, self.height, self.width)


@dataclass(frozen=True)
class VideoSpec:
    """One video to generate (text-to-video). `fps` only matters when the frames are encoded to
    a file. Pure data like `RequestSpec`, so the router, the simulator and the engine share it."""

    request_id: str
    model: str
    prompt: str
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    fps: int = 16
    negative_prompt: str = ""
    kind: str = "t2v"

    @property
    def uses_cfg(self) -> bool:
        # Same rule as WanPipeline's `do_classifier_free_guidance`.
        return self.guidance_scale > 1.0


class RequestStatus(str, Enum):
    QUEUED = "queued"  # waiting for a worker (conditioning may still be in flight)
    RUNNING = "running"  # resident on a worker, stepping
    FINISHED = "finished"  # all denoising steps done; latents handed back
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about one request."""

    request_id: str
    shape_key: ShapeKey
    uses_cfg: bool
    steps_done: int
    steps_total: int
    arrival_time: float
    ready: bool  # conditioning (text embeddings) is available, so a worker can admit it
    worker_id: str | None  # None while queued

    @property
    def steps_left(self) -> int:
        return self.steps_total - self.steps_done


@dataclass(frozen=True)
class WorkerView:
    """What a policy may know about one denoiser worker."""

    worker_id: str
    max_batch_size: int  # requests that may be resident and step together
    running: tuple[str, ...]  # resident request ids, in admission order


@dataclass(frozen=True)
class ClusterSnapshot:
    now: float
    queued: tuple[RequestView, ...]  # arrival (FCFS) order
    running: tuple[RequestView, ...]  # resident on some worker
    workers: tuple[WorkerView, ...]

    def worker(self, worker_id: str) -> WorkerView:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        raise KeyError(worker_id)

    def running_on(self, worker_id: str) -> tuple[RequestView, ...]:
        return tuple(r for r in self.running if r.worker_id == worker_id)


@dataclass(frozen=True)
class WorkerPlan:
    """One round for one worker: drop, admit, then one forward per group.

    `drop` is filled by the router (cancellations), never by a policy. Every id in `groups`
    advances exactly one step; requests in a group share a shape key. A policy that holds work
    back on purpose (a batching window) sets `wake_at`: the router asks again at that time even
    if nothing else happens.
    """

    worker_id: str
    admit: tuple[str, ...] = ()
    groups: tuple[tuple[str, ...], ...] = ()
    drop: tuple[str, ...] = ()
    wake_at: float | None = None

    @property
    def stepping(self) -> tuple[str, ...]:
        return tuple(rid for group in self.groups for rid in group)

    @property
    def is_empty(self) -> bool:
        return not (self.admit or self.groups or self.drop)


@dataclass(frozen=True)
class RequestProgress:
    request_id: str
    steps_done: int
    steps_total: int


@dataclass(frozen=True)
class StepReport:
    """A worker's answer to a `WorkerPlan`."""

    worker_id: str
    progress: tuple[RequestProgress, ...]  # every request that stepped (or was admitted)
    finished: tuple[str, ...]  # all steps done; latents returned alongside the report
    failed: tuple[tuple[str, str], ...] = ()  # (request_id, message)
    duration_s: float = 0.0  # time spent executing the plan
    batch_size: int = 0  # requests that stepped this round
