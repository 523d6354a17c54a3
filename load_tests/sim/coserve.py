"""The co-serving simulator: images and videos on one worker pool, decided by the real
`CoServeCore` (GenServe's per-round scheduler), with time from a profiled cost model.

What it models, in the live system's order:

1. A request arrives at its workload offset; half the per-request overhead passes, then it is
   submitted with its deadline (arrival + SLO).
2. Its texts go to the text encoder (the same queueing model as the image simulator); when the
   embeddings arrive it is ready.
3. Whenever something changes (ready, a step boundary, a decode finishing on a worker) the core
   decides the round once, and every assignment it hands out runs for its profiled time: an
   image batch's step (`image_step_seconds` at its rows), a video's step at its SP degree on all
   members at once (`video_step_seconds`), a finished video's VAE decode on one worker.
4. A finished image goes to the VAE decoder service; a decoded video is complete. The rest of
   the request overhead passes before the response.

Pausing and moving a video are charged no time: GenServe measures both under 1 ms against
steps of hundreds (Table 7). The scheduler's own decision time is measured (wall clock) but
not charged in simulated time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stepserve.actors.coserve_core import (
    CoServeCore,
    ImageStep,
    JobStatus,
    VideoDecode,
    VideoPause,
    VideoStep,
)
from stepserve.actors.router_core import QueueFullError
from stepserve.policies.cost_model import ProfiledCostModel
from stepserve.policies.genserve import GenServeConfig, ProfiledStepCosts
from stepserve.policies.types import RequestSpec, VideoSpec

from ..records import RequestRecord, record_of
from ..workload import ScheduledRequest
from .events import EventQueue
from .services import DecoderService, TextEncoderService, TextEncoderSpec


@dataclass(frozen=True)
class CoServeSimConfig:
    workers: int = 8
    genserve: GenServeConfig = field(default_factory=GenServeConfig)
    max_queue_len: int = 1024
    text_encoder: TextEncoderSpec = TextEncoderSpec()
    decoders: int = 1  # image VAE decoder replicas (videos decode on a worker)
    submit_overhead_share: float = 0.5

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CoServeTrace:
    index: int
    request_id: str
    kind: str  # image | video
    request_class: str
    model: str
    width: int
    height: int
    frames: int
    steps: int
    arrival_s: float
    submit_s: float | None
    admit_s: float | None  # first step started
    completion_s: float | None
    deadline_s: float | None
    status: str  # finished | rejected | unfinished
    pauses: int = 0
    degrees: tuple[int, ...] = ()  # the SP degree of every step, in order (videos)

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
class CoServeResult:
    config: CoServeSimConfig
    traces: tuple[CoServeTrace, ...]
    busy_s: dict[str, float]
    end_s: float
    decisions: int
    decision_wall_s: tuple[float, ...]  # each scheduling call's wall time (the solver included)
    wall_s: float

    def records(self, kind: str | None = None) -> list[RequestRecord]:
        return [t.to_record() for t in self.traces if kind is None or t.kind == kind]


class _Entry:
    __slots__ = ("request", "spec", "kind", "texts", "submit_s", "completion_s", "status")

    def __init__(self, request: ScheduledRequest, spec: RequestSpec | VideoSpec, kind: str) -> None:
        self.request, self.spec, self.kind = request, spec, kind
        self.texts = (spec.prompt, spec.negative_prompt) if spec.uses_cfg else (spec.prompt,)
        self.submit_s = self.completion_s = None
        self.status = "unfinished"


class CoServeSimulation:
    def __init__(self, requests: Sequence[ScheduledRequest], cost: ProfiledCostModel,
                 config: CoServeSimConfig = CoServeSimConfig()) -> None:
        self.config = config
        self.cost = cost
        self.events = EventQueue()
        self.worker_ids = tuple(f"w{i}" for i in range(config.workers))
        self.step_costs = ProfiledStepCosts(cost)
        self.core = CoServeCore(self.worker_ids, config.genserve, self.step_costs, config.max_queue_len)
        self.encoder = TextEncoderService(config.text_encoder, self.events, self._delay, cost.text_encode_seconds,
                                          self._on_ready)
        self.decoder = DecoderService(config.decoders, self.events, self._delay, self._on_image_decoded)
        self.busy_s = dict.fromkeys(self.worker_ids, 0.0)
        self.entries: dict[str, _Entry] = {}
        self.decision_wall: list[float] = []
        self._decide_pending = False
        for request in requests:
            if request.model is None:
                raise ValueError(f"request {request.index} has no model; the simulator needs one to cost it")
            common = dict(request_id=f"r{request.index}", model=request.model, prompt=request.prompt,
                          width=request.width, height=request.height,
                          num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
                          seed=request.seed, negative_prompt=request.negative_prompt)
            if request.is_video:
                spec, kind = VideoSpec(num_frames=request.num_frames, fps=request.fps, **common), "video"
            else:
                spec, kind = RequestSpec(**common), "image"
            entry = _Entry(request, spec, kind)
            self.entries[spec.request_id] = entry
            self.events.at(request.offset_s, self._arrive, entry)

    # -- requests ----------------------------------------------------------------------------

    def _delay(self, seconds: float, callback, *args) -> None:
        self.events.at(self.events.now + seconds, callback, *args)

    def _overhead(self, entry: _Entry, share: float) -> float:
        return share * self.cost.request_overhead_seconds(entry.spec.model)

    def _arrive(self, entry: _Entry) -> None:
        self._delay(self._overhead(entry, self.config.submit_overhead_share), self._submit, entry)

    def _submit(self, entry: _Entry) -> None:
        now = self.events.now
        slo = entry.request.slo_s
        deadline = math.inf if slo is None else entry.request.offset_s + slo
        # What follows the last step (decode, then the rest of the overhead), predicted from the
        # profile as a live router would: the scheduler plans denoising to end that much earlier.
        spec = entry.spec
        tail = self._overhead(entry, 1 - self.config.submit_overhead_share)
        try:
            if entry.kind == "video":
                tail += self.cost.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames)
                self.core.submit_video(spec, now, deadline, tail)
            else:
                tail += self.cost.decode_seconds(spec.model, spec.height, spec.width)
                self.core.submit_image(spec, now, deadline, tail)
        except QueueFullError:
            self._delay(self._overhead(entry, 1 - self.config.submit_overhead_share), self._complete, entry,
                        "rejected")
            return
        entry.submit_s = now
        self.encoder.submit(entry.spec.request_id, entry.spec.model, entry.texts)

    def _on_ready(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.core.mark_ready(rid)
        self._request_decision()

    def _on_image_decoded(self, request_id: str, started: float) -> None:
        entry = self.entries[request_id]
        self._delay(self._overhead(entry, 1 - self.config.submit_overhead_share), self._complete, entry, "finished")

    def _complete(self, entry: _Entry, status: str) -> None:
        entry.completion_s = self.events.now
        entry.status = status

    # -- rounds ------------------------------------------------------------------------------

    def _request_decision(self) -> None:
        # Many events land on one instant (a burst of ready requests, a group's members); one
        # decision after all of them, as the live router's single decide task would make.
        if not self._decide_pending:
            self._decide_pending = True
            self.events.at(self.events.now, self._decide)

    def _decide(self) -> None:
        self._decide_pending = False
        now = self.events.now
        started = time.perf_counter()
        assignments = self.core.schedule(now)
        self.decision_wall.append(time.perf_counter() - started)
        for a in assignments:
            if isinstance(a, ImageStep):
                spec = self.entries[a.request_ids[0]].spec
                rows = sum(2 if self.entries[r].spec.uses_cfg else 1 for r in a.request_ids)
                seconds = self.step_costs.image_step_seconds(spec.model, spec.height, spec.width, rows)
                self._run(a.worker_id, seconds, self._image_done, a)
            elif isinstance(a, VideoStep):
                spec = self.entries[a.job_id].spec
                seconds = self.step_costs.video_step_seconds(spec.model, spec.height, spec.width, spec.num_frames,
                                                             len(a.workers))
                for w in a.workers:
                    self.busy_s[w] += seconds
                self._delay(seconds, self._video_done, a)
            elif isinstance(a, VideoDecode):
                spec = self.entries[a.job_id].spec
                seconds = self.cost.decode_seconds(spec.model, spec.height, spec.width, spec.num_frames)
                self._run(a.worker_id, seconds, self._decode_done, a)
            elif not isinstance(a, VideoPause):  # a pause takes no simulated time
                raise TypeError(f"unknown assignment {a!r}")
        if any(isinstance(a, VideoPause) for a in assignments):
            self._request_decision()  # the paused group's workers are free for the next round

    def _run(self, worker_id: str, seconds: float, callback, assignment) -> None:
        self.busy_s[worker_id] += seconds
        self._delay(seconds, callback, assignment)

    def _image_done(self, step: ImageStep) -> None:
        now = self.events.now
        for rid in self.core.image_step_done(step.worker_id, now):
            spec = self.entries[rid].spec
            self.decoder.submit(rid, self.cost.decode_seconds(spec.model, spec.height, spec.width))
        self._request_decision()

    def _video_done(self, step: VideoStep) -> None:
        self.core.video_step_done(step.job_id, self.events.now)
        self._request_decision()

    def _decode_done(self, decode: VideoDecode) -> None:
        self.core.video_decoded(decode.job_id, decode.worker_id, self.events.now)
        entry = self.entries[decode.job_id]
        self._delay(self._overhead(entry, 1 - self.config.submit_overhead_share), self._complete, entry, "finished")
        self._request_decision()

    # -- running -----------------------------------------------------------------------------

    def run(self) -> CoServeResult:
        started = time.perf_counter()
        self.events.run()
        wall = time.perf_counter() - started
        return CoServeResult(self.config, tuple(self._trace(e) for e in self.entries.values()), dict(self.busy_s),
                             self.events.now, self.core.decisions, tuple(self.decision_wall), wall)

    def _trace(self, entry: _Entry) -> CoServeTrace:
        request, spec = entry.request, entry.spec
        admit = pauses = None
        degrees: tuple[int, ...] = ()
        if entry.submit_s is not None:
            state = self.core.state(spec.request_id)
            admit, pauses, degrees = state.admit_time, state.pauses, state.degrees
            if state.status is not JobStatus.FINISHED and entry.status == "finished":
                raise AssertionError(f"{spec.request_id} completed but the core says {state.status}")
        return CoServeTrace(
            index=request.index, request_id=spec.request_id, kind=entry.kind, request_class=request.request_class,
            model=spec.model, width=spec.width, height=spec.height, frames=request.num_frames or 1,
            steps=spec.num_inference_steps, arrival_s=request.offset_s, submit_s=entry.submit_s, admit_s=admit,
            completion_s=entry.completion_s,
            deadline_s=None if request.slo_s is None else request.offset_s + request.slo_s, status=entry.status,
            pauses=pauses or 0, degrees=degrees,
        )


def simulate_coserve(requests: Sequence[ScheduledRequest], cost: ProfiledCostModel,
                     config: CoServeSimConfig = CoServeSimConfig()) -> CoServeResult:
    return CoServeSimulation(requests, cost, config).run()
