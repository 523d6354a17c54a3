"""What a load run records about each request; the live generator and the simulator both emit it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    index: int  # position in the workload
    steps: int  # num_inference_steps asked for
    scheduled_s: float  # when it was due, seconds after the run started
    sent_s: float | None  # when it actually left; None if the run ended first
    # From `scheduled_s` (not `sent_s`) to the full response: a generator that falls behind
    # must show up as latency, not hide it (no coordinated omission).
    latency_s: float | None  # None when no response came (timeout, connection error, deadline)
    status: int | None  # HTTP status; None when no response came
    error: str | None = None  # why it failed, when it did

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def finished_s(self) -> float | None:
        return None if self.latency_s is None else self.scheduled_s + self.latency_s
