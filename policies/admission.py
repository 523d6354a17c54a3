"""Admission at the edge: shed overload in milliseconds, before any work is spent on it.

The router publishes a `LoadReport` whenever its load changes; every ingress replica keeps the
latest one and answers `admit(report, kind, pending)` for each request before asking the router
for anything. The router applies the same rule again when the request reaches it, so the bound
holds exactly there.

What counts as backlog is everything admitted that has not finished: queued, running and being
decoded. Decoding used to be a second queue the router did not see; counting it here means a
slow decoder sheds load instead of piling it up.

Between two reports an edge counts what it let in itself (`EdgeLedger`): every report says how
many of this edge's requests the router had received when it was taken, so the requests still
on their way are known exactly and held against the bound, whatever the report said. A burst
that arrives while the pool is quiet is therefore cut at the bound by the edge itself, not
passed whole to the router to be refused one by one behind the work it is doing.

Far from every bound (`is_quiet`) the router does not republish its load on every admission and
finish, only when it stops being quiet: at light load that was most of the app's messages (two
or three long-poll answers per request). The edge asks for a fresh report itself when what it
let in since its report would make the load no longer quiet (`EdgeLedger.stale`), so light load
still costs one long poll every few seconds and a burst a few answers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
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
    """The router's load as one edge sees it: the counts as they were when the router answered."""

    version: int  # the router's published version: it increases with every change the edge must hear of
    live_workers: int
    classes: dict[RequestKind, ClassLoad] = field(default_factory=dict)
    router_id: str = ""  # the router incarnation that answered: `received` counts from zero in each
    # Requests of each class the asking edge had submitted that the router had received when it
    # answered (refused ones too): what the edge sent beyond them is still on its way.
    received: dict[RequestKind, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    status: int = 200  # 429 (over capacity) or 503 (nothing can serve it now)
    message: str = ""
    retry_after_s: float | None = None


ADMITTED = Verdict(True)
NO_WORKER_RETRY_S = 5.0


def is_quiet(report: LoadReport, pending: Mapping[RequestKind, int] | None = None) -> bool:
    """Whether the load is well inside every bound: every class's backlog (plus `pending`, what
    an edge let in that the report cannot show) under half its queue bound, and its predicted
    queue wait at most half its wait bound, with a worker serving. Between two quiet reports the
    router publishes nothing; the half left over is what an edge may fill before it asks again."""
    if report.live_workers < 1:
        return False
    pending = pending or {}
    for kind, load in report.classes.items():
        if 2 * (load.backlog + pending.get(kind, 0)) >= load.max_queued:
            return False
        if load.max_wait_s is not None:
            wait = load.predicted_wait_s(load.queued + pending.get(kind, 0) + 1)
            if wait is not None and 2 * wait > load.max_wait_s:
                return False
    return True


def admit(report: LoadReport, kind: RequestKind, pending: int = 0, count: int = 1) -> Verdict:
    """Whether `count` more requests of `kind` may enter, all or none (the `n` images of one
    call share their fate). `pending`: requests of `kind` already let in that the report cannot
    show yet (on their way to the router); they are held against the bound like the queued."""
    if report.live_workers < 1:
        return Verdict(False, 503, "no denoiser worker is serving right now", NO_WORKER_RETRY_S)
    load = report.classes.get(kind)
    if load is None:
        return ADMITTED
    backlog = load.backlog + pending + count - 1
    if backlog >= load.max_queued:
        wait = load.predicted_wait_s(backlog - load.max_queued + 1)
        return Verdict(False, 429, f"the {kind.value} queue is full ({load.max_queued} waiting)", _retry_after(wait))
    if load.max_wait_s is not None:
        wait = load.predicted_wait_s(load.queued + pending + count)
        if wait is not None and wait > load.max_wait_s:
            return Verdict(False, 429, f"the predicted queue wait ({wait:.1f} s) exceeds {load.max_wait_s:g} s",
                           _retry_after(wait - load.max_wait_s))
    return ADMITTED


class EdgeLedger:
    """One edge's admission state: the router's last report and what this edge let in since.

    Each request this edge admits is on its way until a report's `received` count passes it
    (oldest first: which of several concurrent submits arrived first does not matter, only how
    many). A new router incarnation counts from zero, and whatever was on its way to the old one
    died with it. A submit that never reaches the router (its caller went away before Serve
    sent it) would otherwise be held against the bound forever: after `lost_after_s` it is
    written off, which errs towards admitting, and the router's own check is exact."""

    def __init__(self, lost_after_s: float = 30.0) -> None:
        self.report: LoadReport | None = None
        self.lost_after_s = lost_after_s
        self._sent: dict[RequestKind, deque[float]] = {kind: deque() for kind in RequestKind}  # send times
        self._received: dict[RequestKind, int] = {}

    def observe(self, report: LoadReport, now: float) -> None:
        if self.report is None or report.router_id != self.report.router_id:
            for sent in self._sent.values():
                sent.clear()
            self._received = dict(report.received)
        elif self._overtaken(report):
            # An answer can overtake a later one (the long poll and a refresh): its backlog misses
            # what the later one counted as received, so taking it would let that much too many in.
            report = self.report
        for kind, sent in self._sent.items():
            arrived = report.received.get(kind, 0) - self._received.get(kind, 0)
            if arrived > 0:
                self._received[kind] = report.received[kind]
                for _ in range(min(arrived, len(sent))):
                    sent.popleft()
            while sent and sent[0] < now - self.lost_after_s:
                sent.popleft()
        self.report = report

    def _overtaken(self, report: LoadReport) -> bool:
        """Whether `report`, from the current router, was answered before the one already held."""
        return report.version < self.report.version or any(
            count < self._received.get(kind, 0) for kind, count in report.received.items())

    def forget(self) -> None:
        """The router is gone (restarting): nothing it said holds any more."""
        self.report = None

    def in_flight(self, kind: RequestKind) -> int:
        return len(self._sent[kind])

    def verdict(self, kind: RequestKind, count: int = 1) -> Verdict:
        """Whether `count` requests of `kind` would be admitted now. Needs a report (the
        router's first answer)."""
        if self.report is None:
            raise RuntimeError("admission needs a report: wait for the router's first answer")
        return admit(self.report, kind, self.in_flight(kind), count)

    def admit(self, kind: RequestKind, now: float, count: int = 1) -> Verdict:
        """The verdict for `count` requests of `kind`, counted as sent at `now` when admitted."""
        verdict = self.verdict(kind, count)
        if verdict.admitted:
            self._sent[kind].extend([now] * count)
        return verdict

    @property
    def stale(self) -> bool:
        """The report was quiet, so the router will not say when it stops being quiet, but what
        this edge let in since makes it so: time to ask for a fresh one."""
        if self.report is None or not is_quiet(self.report):
            return False
        return not is_quiet(self.report, {kind: len(sent) for kind, sent in self._sent.items()})


def _retry_after(seconds: float | None) -> float:
    # Whole seconds, as the Retry-After header carries them; at least one.
    if seconds is None or not math.isfinite(seconds):
        return 1.0
    return float(max(1, math.ceil(seconds)))
