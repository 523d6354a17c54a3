"""When the edge must hear of a load change (`is_quiet`), and what one edge counts between two
reports (`EdgeLedger`); the gate around it is in test_edge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve.policies.admission import ClassLoad, EdgeLedger, LoadReport, admit, is_quiet
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


def test_what_is_pending_counts_against_a_quiet_report_too():
    quiet = report(t2i={"queued": 1, "decoding": 0, "max_queued": 4, "drain_per_s": None})
    assert admit(quiet, T2I, pending=2).admitted and not admit(quiet, T2I, pending=3).admitted
    assert not admit(quiet, T2I, pending=1, count=3).admitted  # all or none
    assert not is_quiet(quiet, {T2I: 1}) and is_quiet(quiet, {T2V: 5})


def test_pending_requests_lengthen_the_predicted_wait():
    load = report(t2i={"queued": 2, "decoding": 0, "max_queued": 100, "drain_per_s": 1.0, "max_wait_s": 5.0})
    assert admit(load, T2I, pending=2).admitted  # 5 ahead drain in 5 s
    assert not admit(load, T2I, pending=3).admitted


def answered(received=0, queued=0, router_id="r1", version=1) -> LoadReport:
    return replace(report(t2i={"queued": queued, "decoding": 0, "max_queued": 8, "drain_per_s": None}),
                   version=version, router_id=router_id, received={T2I: received})


def test_a_ledger_holds_what_it_let_in_until_a_report_has_it():
    ledger = EdgeLedger()
    ledger.observe(answered(received=5), now=0.0)  # an earlier life's requests, all arrived
    for t in range(3):
        assert ledger.admit(T2I, now=float(t)).admitted
    assert ledger.in_flight(T2I) == 3 and ledger.in_flight(T2V) == 0
    ledger.observe(answered(received=7, queued=2), now=3.0)
    assert ledger.in_flight(T2I) == 1
    # An older answer, overtaken: it counts one fewer arrived and one fewer queued. Taking its
    # backlog with the later count would forget the request both the later answer counted.
    ledger.observe(answered(received=6, queued=1), now=3.1)
    assert ledger.in_flight(T2I) == 1 and ledger.report.classes[T2I].queued == 2
    assert ledger.admit(T2I, now=4.0, count=5).admitted  # 2 queued + 6 on their way: the bound
    assert not ledger.admit(T2I, now=4.0).admitted
    assert ledger.in_flight(T2I) == 6


def test_an_answer_of_an_older_version_is_overtaken_too():
    ledger = EdgeLedger()
    ledger.observe(answered(received=3, queued=5, version=4), now=0.0)
    ledger.observe(answered(received=3, queued=1, version=3), now=0.1)  # the same count, an older load
    assert ledger.report.version == 4 and ledger.report.classes[T2I].queued == 5
    ledger.observe(answered(received=3, queued=1, version=5), now=0.2)
    assert ledger.report.classes[T2I].queued == 1


def test_a_new_router_starts_the_count_again():
    ledger = EdgeLedger()
    ledger.observe(answered(received=0), now=0.0)
    ledger.admit(T2I, now=0.0, count=4)
    ledger.observe(answered(received=1, router_id="r2"), now=1.0)  # what was on its way died with r1
    assert ledger.in_flight(T2I) == 0
    ledger.admit(T2I, now=1.0)
    ledger.observe(answered(received=2, router_id="r2"), now=2.0)
    assert ledger.in_flight(T2I) == 0


def test_a_submit_that_never_arrives_is_written_off():
    ledger = EdgeLedger(lost_after_s=30.0)
    ledger.observe(answered(received=0), now=0.0)
    ledger.admit(T2I, now=0.0)
    ledger.admit(T2I, now=20.0)
    ledger.observe(answered(received=0), now=29.0)
    assert ledger.in_flight(T2I) == 2
    ledger.observe(answered(received=0), now=31.0)
    assert ledger.in_flight(T2I) == 1


def test_stale_when_what_was_let_in_ends_the_quiet():
    ledger = EdgeLedger()
    assert not ledger.stale  # no report
    ledger.observe(answered(queued=1), now=0.0)
    ledger.admit(T2I, now=0.0, count=2)
    assert not ledger.stale  # 3 of 8
    ledger.admit(T2I, now=0.0)
    assert ledger.stale  # 4 of 8: the router would have published this, had it seen it
    ledger.observe(answered(received=3, queued=5), now=0.1)
    assert not ledger.stale  # a busy report: the router publishes every change itself


def test_admit_needs_a_report():
    with pytest.raises(RuntimeError, match="report"):
        EdgeLedger().admit(T2I, now=0.0)
    with pytest.raises(RuntimeError, match="report"):
        EdgeLedger().verdict(T2I)
