"""When the edge must hear of a load change: `is_quiet` (the rest of `admit` is in test_edge)."""

from __future__ import annotations

import pytest

from stepserve.policies.admission import ClassLoad, LoadReport, admit, is_quiet
from stepserve.policies.types import RequestKind

T2I, T2V = RequestKind.T2I, RequestKind.T2V


def report(live_workers=2, **classes) -> LoadReport:
    return LoadReport(version=1, live_workers=live_workers, classes={
        RequestKind(kind): ClassLoad(running=0, **fields) for kind, fields in classes.items()})


@pytest.mark.parametrize("queued, decoding, max_queued, quiet", [
    (0, 0, 8, True), (3, 0, 8, True), (2, 1, 8, True),
    (4, 0, 8, False), (2, 2, 8, False),  # half the bound, counting what is being decoded
    (0, 0, 1, True), (1, 0, 1, False), (1, 0, 3, True), (2, 0, 3, False),
])
def test_quiet_is_a_backlog_under_half_the_bound(queued, decoding, max_queued, quiet):
    load = report(t2i={"queued": queued, "decoding": decoding, "max_queued": max_queued, "drain_per_s": None})
    assert is_quiet(load) is quiet


def test_every_class_must_be_quiet_and_a_worker_must_serve():
    images = {"queued": 0, "decoding": 0, "max_queued": 8, "drain_per_s": None}
    assert is_quiet(report(t2i=images, t2v={**images, "queued": 1}))
    assert not is_quiet(report(t2i=images, t2v={**images, "queued": 4}))
    assert not is_quiet(report(live_workers=0, t2i=images))
    assert is_quiet(report())  # no bounded class at all


def test_a_predicted_wait_over_half_its_bound_is_not_quiet():
    waits = {"decoding": 0, "max_queued": 100, "drain_per_s": 2.0, "max_wait_s": 4.0}
    assert is_quiet(report(t2i={**waits, "queued": 3}))  # 4 ahead drain in 2 s: half the bound
    assert not is_quiet(report(t2i={**waits, "queued": 4}))  # 2.5 s
    assert is_quiet(report(t2i={**waits, "queued": 40, "drain_per_s": None, "max_queued": 100}))  # unmeasured


def test_a_quiet_report_admits_whatever_is_pending_and_a_busy_one_counts_it():
    quiet = report(t2i={"queued": 1, "decoding": 0, "max_queued": 4, "drain_per_s": None})
    busy = report(t2i={"queued": 2, "decoding": 0, "max_queued": 4, "drain_per_s": None})
    assert admit(quiet, T2I, pending=100).admitted
    assert admit(busy, T2I, pending=1).admitted and not admit(busy, T2I, pending=2).admitted
