"""The co-serving router's state machine: images and videos on one pool of workers, decided
globally every round by GenServe's scheduler (policies/genserve).

The image-only `RouterCore` lets each worker loop plan for itself; a video with sequence
parallelism needs several workers at one step boundary, and pausing it frees workers other
requests are waiting for, so here one decision covers the whole pool. It is made whenever
something changes (an arrival, a step boundary, a pause) and acted on only by workers that are
free: a worker still inside a step picks up its part of the plan at its own boundary, when the
core decides again.

No Ray, no asyncio, no clock, as `RouterCore`: the live router and the simulator both feed it
events and execute the `Assignment`s it hands out, so they make the same decisions.

Execution model, per assignment (each occupies its workers until reported done):
- `ImageStep`: one forward of one EDF batch on one worker. Members resident on another free
  worker move with it (`moves`); members inside another worker's step sit this one out.
- `VideoStep`: one step of one video on its SP group, every member at once. Its state comes
  from where it is: nowhere yet (`new`), the same group (`resident`), host memory after a pause
  (`host`), or the previous group when the degree or the workers change (`move`).
- `VideoPause`: the video's state leaves its group for host memory at a step boundary; the
  group is free for the same decision's other work.
- `VideoDecode`: the finished video's VAE decode on the first worker of its last group
  (GenServe: decode does not benefit from SP).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from stepserve.actors.router_core import DuplicateRequestError, QueueFullError
from stepserve.policies.genserve import (
    GenServeConfig,
    ImageRequest,
    MemoizedCosts,
    RoundDecision,
    RoundInput,
    StepCosts,
    VideoAction,
    VideoJob,
    VideoStatus,
    decide_round,
)
from stepserve.policies.types import RequestSpec, VideoSpec


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"  # images: resident on a worker; videos: holding an SP group
    PAUSED = "paused"  # videos only: state in host memory
    DECODING = "decoding"  # videos only: denoised, its VAE decode is running
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.FINISHED, JobStatus.FAILED)


@dataclass(frozen=True)
class ImageStep:
    worker_id: str
    request_ids: tuple[str, ...]  # the batch, earliest deadline first; all step once
    admit: tuple[str, ...]  # new on any worker (from the queue)
    moves: tuple[tuple[str, str], ...]  # (request id, worker it leaves) for members moved here


@dataclass(frozen=True)
class VideoStep:
    job_id: str
    workers: tuple[str, ...]  # the SP group, rank order
    source: str  # "new" | "resident" | "host" | "move"
    from_workers: tuple[str, ...] = ()  # the old group, for "move"


@dataclass(frozen=True)
class VideoPause:
    job_id: str
    workers: tuple[str, ...]  # the group it leaves; its state goes to host memory


@dataclass(frozen=True)
class VideoDecode:
    job_id: str
    worker_id: str


Assignment = ImageStep | VideoStep | VideoPause | VideoDecode


@dataclass
class _Job:
    kind: str  # "image" | "video"
    spec: RequestSpec | VideoSpec
    arrival: float
    deadline: float
    status: JobStatus = JobStatus.QUEUED
    ready: bool = False
    steps_done: int = 0
    workers: tuple[str, ...] = ()  # images: (resident worker,); videos: the group holding the state
    tail_s: float = 0.0  # seconds it still needs after its last denoising step
    admit_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    pauses: int = 0
    degrees: list[int] = field(default_factory=list)  # videos: every SP degree it stepped at, in order

    @property
    def steps_total(self) -> int:
        return self.spec.num_inference_steps


@dataclass(frozen=True)
class JobState:
    job_id: str
    kind: str
    status: JobStatus
    steps_done: int
    steps_total: int
    workers: tuple[str, ...]
    arrival_time: float
    admit_time: float | None
    finish_time: float | None
    error: str | None
    pauses: int
    degrees: tuple[int, ...]


class CoServeCore:
    def __init__(self, workers: Sequence[str], config: GenServeConfig, costs: StepCosts,
                 max_queue_len: int = 256) -> None:
        if not workers:
            raise ValueError("CoServeCore needs at least one worker")
        if len(set(workers)) != len(workers):
            raise ValueError(f"duplicate worker ids in {list(workers)}")
        if max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
        self.workers = tuple(workers)
        self.config = config
        # Kept across rounds: the same few shapes are costed every round.
        self.costs = costs if isinstance(costs, MemoizedCosts) else MemoizedCosts(costs)
        self.max_queue_len = max_queue_len
        self._jobs: dict[str, _Job] = {}
        self._busy: dict[str, Assignment] = {}  # worker -> what it is executing
        self.decisions = 0
        self.last_decision: RoundDecision | None = None

    def set_costs(self, costs: StepCosts) -> None:
        """Predict from `costs` from the next decision on (the live router re-calibrates the
        profile with what steps really take); the memo starts afresh."""
        self.costs = costs if isinstance(costs, MemoizedCosts) else MemoizedCosts(costs)

    # ---- work in ----

    # `tail_s`: the predicted time from the request's last denoising step to its response (VAE
    # decode, encoding, the way out). The scheduler only plans denoising, so it is asked to
    # finish that by `deadline - tail_s`; otherwise a 768 px video whose decode takes seconds
    # looks seconds early while it is exactly on time, and is paused into a miss.

    def submit_image(self, spec: RequestSpec, now: float, deadline: float = math.inf, tail_s: float = 0.0) -> None:
        self._submit("image", spec, now, deadline, tail_s)

    def submit_video(self, spec: VideoSpec, now: float, deadline: float = math.inf, tail_s: float = 0.0) -> None:
        self._submit("video", spec, now, deadline, tail_s)

    def _submit(self, kind: str, spec, now: float, deadline: float, tail_s: float = 0.0) -> None:
        old = self._jobs.get(spec.request_id)
        if old is not None and not old.status.is_terminal:
            raise DuplicateRequestError(f"request {spec.request_id!r} is already {old.status.value}")
        if self.queue_length >= self.max_queue_len:
            raise QueueFullError(f"queue full ({self.max_queue_len} requests waiting)")
        if spec.num_inference_steps < 1:
            raise ValueError(f"request {spec.request_id!r}: num_inference_steps must be >= 1")
        if not (tail_s >= 0 and math.isfinite(tail_s)):
            raise ValueError(f"request {spec.request_id!r}: tail_s must be a finite number >= 0, got {tail_s!r}")
        self._jobs.pop(spec.request_id, None)
        self._jobs[spec.request_id] = _Job(kind, spec, now, deadline, tail_s=tail_s)

    def mark_ready(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is not None and not job.status.is_terminal:
            job.ready = True

    # ---- deciding ----

    def schedule(self, now: float) -> list[Assignment]:
        """Decide the round and hand out the work free workers can start now."""
        out: list[Assignment] = []
        for job_id, job in self._jobs.items():  # a finished video's decode comes first
            if job.status is JobStatus.DECODING and job.workers and job.workers[0] not in self._busy:
                decode = VideoDecode(job_id, job.workers[0])
                self._busy[decode.worker_id] = decode
                job.workers = ()
                out.append(decode)
        free = [w for w in self.workers if w not in self._busy]
        if not free or not self._has_work():
            return out
        decision = decide_round(self._round_input(now), self.config, self.costs)
        self.decisions += 1
        self.last_decision = decision
        free_set = set(free)
        # Pauses first: they free the workers the rest of the plan hands out. A video inside a
        # step pauses at its boundary, when the core decides again.
        for vd in decision.videos:
            job = self._jobs[vd.job_id]
            held = job.workers
            if vd.action is VideoAction.PAUSE and held and free_set.issuperset(held):
                job.status, job.workers = JobStatus.PAUSED, ()
                job.pauses += 1
                out.append(VideoPause(vd.job_id, held))
        # Runs next. A worker still holding another video's state (that video keeps, shrinks or
        # moves this round but has not been handled yet) is not free to take: handle videos in
        # passes until none can start, so a video that releases workers goes before one that
        # takes them, whatever their order in the plan.
        owner = {w: job_id for job_id, job in self._jobs.items()
                 if job.kind == "video" and job.status is JobStatus.RUNNING for w in job.workers}
        pending = [vd for vd in decision.videos if vd.action in (VideoAction.KEEP, VideoAction.RUN)]
        progress = True
        while progress:
            progress = False
            for vd in list(pending):
                job = self._jobs[vd.job_id]
                held = job.workers
                if not all(w in free_set and owner.get(w, vd.job_id) == vd.job_id for w in vd.workers):
                    continue
                if not free_set.issuperset(held):
                    continue  # its group is inside a step; it decides again at the boundary
                if job.status is JobStatus.RUNNING:
                    source = "resident" if held == vd.workers else "move"
                else:
                    source = "new" if job.status is JobStatus.QUEUED else "host"
                step = VideoStep(vd.job_id, vd.workers, source, held if source == "move" else ())
                if job.admit_time is None:
                    job.admit_time = now
                for w in held:
                    owner.pop(w, None)
                owner.update(dict.fromkeys(vd.workers, vd.job_id))
                job.status, job.workers = JobStatus.RUNNING, vd.workers
                job.degrees.append(len(vd.workers))
                free_set.difference_update(vd.workers)
                for w in vd.workers:
                    self._busy[w] = step
                out.append(step)
                pending.remove(vd)
                progress = True
        free_set.difference_update(owner)  # still holding a video that could not step yet

        for batch in decision.image_batches:
            if batch.worker_id not in free_set:
                continue
            members, admit, moves = [], [], []
            for rid in batch.request_ids:
                job = self._jobs[rid]
                if job.status is JobStatus.QUEUED:
                    admit.append(rid)
                elif job.workers[0] != batch.worker_id:
                    if job.workers[0] in self._busy:
                        continue  # inside another worker's step: it sits this one out
                    moves.append((rid, job.workers[0]))
                members.append(rid)
            if not members:
                continue
            step = ImageStep(batch.worker_id, tuple(members), tuple(admit), tuple(moves))
            for rid in members:
                job = self._jobs[rid]
                if job.admit_time is None:
                    job.admit_time = now
                job.status, job.workers = JobStatus.RUNNING, (batch.worker_id,)
            free_set.discard(batch.worker_id)
            self._busy[batch.worker_id] = step
            out.append(step)
        return out

    def _has_work(self) -> bool:
        return any(j.ready and j.status in (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED)
                   for j in self._jobs.values())

    def _round_input(self, now: float) -> RoundInput:
        # A worker running a video's VAE decode is out of the round: the decode takes seconds
        # (not a step) and is not the scheduler's to move, so counting it would let the plan
        # hand it an image or a share of an SP group that then waits seconds for it while the
        # rest of the plan's workers idle. Workers inside a step are in (they rejoin within a
        # step) but marked busy, so new work goes to free workers first.
        decoding = {w for w, a in self._busy.items() if isinstance(a, VideoDecode)}
        pool = tuple(w for w in self.workers if w not in decoding)
        images, videos = [], []
        for job_id, job in self._jobs.items():
            if not job.ready or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED):
                continue
            spec = job.spec
            left = job.steps_total - job.steps_done
            deadline = job.deadline - job.tail_s
            if job.kind == "image":
                home = job.workers[0] if job.workers and job.workers[0] not in decoding else None
                images.append(ImageRequest(job_id, spec.shape_key, 2 if spec.uses_cfg else 1, left, deadline,
                                           job.arrival, home))
            else:
                status = {JobStatus.QUEUED: VideoStatus.QUEUED, JobStatus.RUNNING: VideoStatus.RUNNING,
                          JobStatus.PAUSED: VideoStatus.PAUSED}[job.status]
                videos.append(VideoJob(job_id, spec.model, spec.height, spec.width, spec.num_frames, left,
                                       deadline, job.arrival, status, job.workers))
        busy = frozenset(w for w in self._busy if w not in decoding)
        return RoundInput(now, pool, tuple(images), tuple(videos), busy)

    # ---- reports in ----

    def image_step_done(self, worker_id: str, now: float) -> list[str]:
        """The worker's `ImageStep` ran: each member advanced one step. Returns the ids that
        finished denoising (their latents go to the decoder)."""
        step = self._release(worker_id, ImageStep)
        finished = []
        for rid in step.request_ids:
            job = self._jobs.get(rid)
            if job is None or job.status is not JobStatus.RUNNING:
                continue  # failed or cancelled meanwhile
            job.steps_done += 1
            if job.steps_done >= job.steps_total:
                job.status, job.workers, job.finish_time = JobStatus.FINISHED, (), now
                finished.append(rid)
        return finished

    def video_step_done(self, job_id: str, now: float) -> bool:
        """Its `VideoStep` ran on every member. True when the video is denoised (decode next)."""
        job = self._jobs[job_id]
        step = None
        for w in job.workers:
            step = self._release(w, VideoStep)
        if step is None:
            raise ValueError(f"video {job_id!r} was not stepping")
        job.steps_done += 1
        if job.steps_done >= job.steps_total:
            job.status = JobStatus.DECODING
            return True
        return False

    def video_decoded(self, job_id: str, worker_id: str, now: float) -> None:
        self._release(worker_id, VideoDecode)
        job = self._jobs[job_id]
        job.status, job.finish_time = JobStatus.FINISHED, now

    def fail(self, job_id: str, message: str, now: float) -> bool:
        """End a live job as FAILED (its text encoding or a worker failed). Workers it occupies
        stay busy until their own report arrives."""
        job = self._jobs.get(job_id)
        if job is None or job.status.is_terminal:
            return False
        job.status, job.workers, job.finish_time, job.error = JobStatus.FAILED, (), now, message
        return True

    def worker_done(self, worker_id: str) -> None:
        """Free a worker whose assignment ended without a normal report (it failed)."""
        self._busy.pop(worker_id, None)

    def _release(self, worker_id: str, kind: type) -> Assignment:
        current = self._busy.pop(worker_id, None)
        if not isinstance(current, kind):
            raise ValueError(f"worker {worker_id!r} reported a {kind.__name__}, but was running {current!r}")
        return current

    # ---- reading state ----

    def state(self, job_id: str) -> JobState:
        job = self._jobs[job_id]
        return JobState(job_id, job.kind, job.status, job.steps_done, job.steps_total, job.workers, job.arrival,
                        job.admit_time, job.finish_time, job.error, job.pauses, tuple(job.degrees))

    def forget(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is not None:
            if not job.status.is_terminal:
                raise ValueError(f"job {job_id!r} is {job.status.value}")
            del self._jobs[job_id]

    @property
    def queue_length(self) -> int:
        return sum(1 for j in self._jobs.values() if j.status in (JobStatus.QUEUED, JobStatus.PAUSED))

    def busy(self, worker_id: str) -> bool:
        return worker_id in self._busy
