"""What a load run records about each request; the live generator and the simulator both emit it,
so one `metrics.summarize` serves both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator imports this module
    from stepserve.load_tests.sim.simulator import RequestTrace


@dataclass(frozen=True)
class RequestRecord:
    index: int  # position in the workload
    steps: int  # num_inference_steps asked for
    scheduled_s: float  # when it was due, seconds after the run started
    sent_s: float | None  # when it actually left; None if the run ended first
    # From `scheduled_s` (not `sent_s`) to the full response: a generator that falls behind
    # must show up as latency, not hide it (no coordinated omission).
    latency_s: float | None  # None when no response came (timeout, connection error, deadline)
    status: int | None  # HTTP status; None when no response came (the simulator uses 200 / 429)
    error: str | None = None  # why it failed, when it did
    # Allowed latency (σ × solo latency, from scheduled_s); None when the run has no SLO.
    slo_s: float | None = None
    # Arrival at the router to admission on a worker; None when unknown (e.g. live without
    # per-request server timings).
    queue_wait_s: float | None = None
    width: int | None = None
    height: int | None = None
    request_class: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def finished_s(self) -> float | None:
        return None if self.latency_s is None else self.scheduled_s + self.latency_s

    @property
    def met_slo(self) -> bool | None:
        """None without an SLO; a failed request never meets it."""
        if self.slo_s is None:
            return None
        return self.ok and self.latency_s is not None and self.latency_s <= self.slo_s


def record_of(trace: RequestTrace) -> RequestRecord:
    """The record of one simulated request, image or video: the same fields a live run records,
    so one metrics implementation serves both."""
    ok = trace.status == "finished"
    return RequestRecord(
        index=trace.index, steps=trace.steps, scheduled_s=trace.arrival_s, sent_s=trace.arrival_s,
        latency_s=trace.latency_s if ok else None,
        status=200 if ok else (429 if trace.status == "rejected" else None),
        error=None if ok else trace.status,
        slo_s=None if trace.deadline_s is None else trace.deadline_s - trace.arrival_s,
        queue_wait_s=None if trace.admit_s is None or trace.submit_s is None else trace.admit_s - trace.submit_s,
        width=trace.width, height=trace.height, request_class=trace.request_class,
    )
