"""Admission at the edge: shed overload in milliseconds, before any work is spent on it.

The router publishes a `LoadReport` whenever its load changes; every ingress replica keeps the
latest one and answers `admit(report, kind, pending)` for each request before asking the router
for anything. The router applies the same rule again when the request reaches it (the ingress's
copy may be a few milliseconds old), so the bound holds exactly there.

What counts as backlog is everything admitted that has not finished: queued, running and being
decoded. Decoding used to be a second queue the router did not see; counting it here means a
slow decoder sheds load instead of piling it up.

Far from every bound (`is_quiet`) the edge has nothing to decide: the router does not republish
its load on every admission and finish then, only when it stops being quiet. At light load that
was most of the app's messages: two or three long-poll answers per request, each a call through
Serve on the ingress and the router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stepserve.policies.types import RequestKind


@dataclass(frozen=True)
class ClassLoad:
    """One request class (images or videos) at the router."""

    queued: int  # waiting for a worker (queued or paused)
    running: int  # resident on workers
    decoding: int  # denoised, being decoded/stored
    max_queued: int  # the class's queue bound
    drain_per_s: float | None  # finished per second, smoothed; None until measured
    max_wait_s: float | None = None  # longest predicted queue wait the class admits; None: no bound

    @property
    def backlog(self) -> int:
        return self.queued + self.decoding

    def predicted_wait_s(self, ahead: int) -> float | None:
        """Seconds until `ahead` more requests of this class drain, at the measured rate."""
        if not self.drain_per_s:
            return None
        return ahead / self.drain_per_s


@dataclass(frozen=True)
class LoadReport:
    version: int  # increases with every change the router publishes
    live_workers: int
    classes: dict[RequestKind, ClassLoad] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    status: int = 200  # 429 (over capacity) or 503 (nothing can serve it now)
    message: str = ""
    retry_after_s: float | None = None


ADMITTED = Verdict(True)
NO_WORKER_RETRY_S = 5.0


def is_quiet(report: LoadReport) -> bool:
    """Whether the load is well inside every bound: every class's backlog under half its queue
    bound, and its predicted queue wait at most half its wait bound, with a worker serving. Between two quiet
    reports the router publishes nothing, so the edge admits on a quiet report without counting
    what it let in since (the router counts exactly); the half left over is what a burst may
    fill before the edge hears that the load is no longer quiet."""
    if report.live_workers < 1:
        return False
    for load in report.classes.values():
        if 2 * load.backlog >= load.max_queued:
            return False
        if load.max_wait_s is not None:
            wait = load.predicted_wait_s(load.queued + 1)
            if wait is not None and 2 * wait > load.max_wait_s:
                return False
    return True


def admit(report: LoadReport, kind: RequestKind, pending: int = 0) -> Verdict:
    """Whether one more request of `kind` may enter. `pending`: requests this caller already let
    in that the report cannot show yet (sent to the router since the report was taken); not
    counted against a quiet report (see `is_quiet`)."""
    if is_quiet(report):
        return ADMITTED
    if report.live_workers < 1:
        return Verdict(False, 503, "no denoiser worker is serving right now", NO_WORKER_RETRY_S)
    load = report.classes.get(kind)
    if load is None:
        return ADMITTED
    backlog = load.backlog + pending
    if backlog >= load.max_queued:
        wait = load.predicted_wait_s(backlog - load.max_queued + 1)
        return Verdict(False, 429, f"the {kind.value} queue is full ({load.max_queued} waiting)", _retry_after(wait))
    if load.max_wait_s is not None:
        # `pending` left out: under load a report lags, and requests counted as pending are
        # often in `queued` already; the router applies the bound again, exactly.
        wait = load.predicted_wait_s(load.queued + 1)
        if wait is not None and wait > load.max_wait_s:
            return Verdict(False, 429, f"the predicted queue wait ({wait:.1f} s) exceeds {load.max_wait_s:g} s",
                           _retry_after(wait - load.max_wait_s))
    return ADMITTED


def _retry_after(seconds: float | None) -> float:
    # Whole seconds, as the Retry-After header carries them; at least one.
    if seconds is None or not math.isfinite(seconds):
        return 1.0
    return float(max(1, math.ceil(seconds)))
