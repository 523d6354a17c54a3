"""The router core's mutable records: one per request (`RequestRecord`), per worker
(`WorkerRecord`) and per plan in flight (`SentPlan`). Only `RouterCore` changes them; the plan
checker reads them through the core's public accessors."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from stepserve.policies.types import RequestSpec, RequestStatus, RequestView, WorkerPlan
from stepserve.routing.lora_residency import LoraResidency


@dataclass(frozen=True)
class WorkerSlot:
    worker_id: str
    max_batch_size: int
    rank: int  # its rank in the workers' process-group world


class RequestRecord:
    __slots__ = ("spec", "arrival", "deadline", "status", "conditioning", "inputs", "host_state", "host_steps", "host_from",
                 "checkpoint", "checkpoint_steps", "checkpoint_time", "steps_done", "steps_planned", "workers",
                 "ready_time", "admit_time", "denoised_time", "finish_time", "error", "pauses", "recoveries", "degrees",
                 "epoch", "view")

    def __init__(self, spec: RequestSpec, arrival: float, deadline: float, inputs: object | None) -> None:
        self.spec = spec
        self.arrival = arrival
        self.deadline = deadline
        self.status = RequestStatus.QUEUED
        # The handle of its text embeddings once ready (None: its worker encodes the prompts).
        self.conditioning: object | None = None
        self.inputs = inputs  # the handle of its control images (None: it has none)
        self.host_state: object | None = None  # its state in host memory while PAUSED
        self.host_steps = 0
        self.host_from: tuple[str, int] | None = None  # the (worker, plan id) producing host_state, until reported
        self.checkpoint: object | None = None
        self.checkpoint_steps = 0
        self.checkpoint_time = arrival
        self.steps_done = 0  # reported
        self.steps_planned = 0  # sent, plans in flight included
        self.workers: tuple[str, ...] = ()  # where its state will be once the plans sent have run
        self.ready_time: float | None = None
        self.admit_time: float | None = None
        self.denoised_time: float | None = None
        self.finish_time: float | None = None
        self.error: str | None = None
        self.pauses = 0
        self.recoveries = 0
        self.degrees: list[int] = []
        self.epoch = 0  # bumped when it is recovered: reports about an older epoch are stale
        self.view: RequestView | None = None

    @property
    def ready(self) -> bool:
        return self.ready_time is not None

    @property
    def needs_steps(self) -> bool:
        return self.steps_planned < self.spec.steps_to_run


@dataclass
class SentPlan:
    plan: WorkerPlan
    sent_at: float
    epochs: dict[str, int]  # the epoch of every request the plan touches
    handles: dict[str, object]  # output id -> handle
    predicted_s: float | None  # the profile's cost of its groups, for calibration
    expected_s: float | None  # what it is expected to take: the prediction plus the measured overhead
    decodes_video: bool  # it ends with a video's VAE decode (seconds, not a step)
    checkpoints: dict[str, int] = field(default_factory=dict)  # checkpointed id -> its steps then


class WorkerRecord:
    def __init__(self, slot: WorkerSlot, lora_resident: int) -> None:
        self.slot = slot
        self.loras = LoraResidency(lora_resident)  # what it holds, as its StoreLoras keeps them
        self.alive = True
        # Leaving the pool (`RouterCore.drain`): no policy sees it; the core moves what it holds.
        self.draining = False
        self.incarnation = ""
        self.residents: dict[str, None] = {}  # as planned, admission order
        self.in_flight: deque[SentPlan] = deque()
        self.drops: dict[str, None] = {}  # router-filled: forget at the next plan
        self.next_plan_id = 1
        self.last_report_at: float | None = None
        self.step_s: float | None = None  # smoothed time a step takes here, report to report
        # It is open (may take a plan) while now >= open_from: -inf when idle, inf when dead or
        # its pipeline is full, else when its plans in flight are predicted to end, less the lead.
        self.open_from = -math.inf
        self.timer = 0  # invalidates an opening time pushed before the last change
        # The plan asked to end early: until it reports, nothing is planned after it (its
        # successor would assume all of its steps ran).
        self.interrupted: int | None = None

    @property
    def cuttable(self) -> bool:
        """Its one plan in flight runs several steps and may be cut short: not one whose group
        spans ranks, since a member cut alone would leave the others waiting in a collective."""
        return (self.alive and self.interrupted is None and len(self.in_flight) == 1
                and self.in_flight[0].plan.steps > 1 and not any(g.ranks for g in self.in_flight[0].plan.groups))

    def free_at(self) -> float | None:
        """When the plans in flight are predicted to have run; None when unknown."""
        if not self.in_flight:
            return None
        head = self.in_flight[0]
        at = head.sent_at if self.last_report_at is None else max(head.sent_at, self.last_report_at)
        for sent in self.in_flight:
            if sent.expected_s is not None:
                at += sent.expected_s
            elif self.step_s is not None:
                at += self.step_s * sent.plan.steps
            else:
                return None
        return at
