"""The slack score exactly as PatchedServe §6.2 writes it, and Algorithm 1's time-out."""

from __future__ import annotations

import math

import pytest

from stepserve.policies.patchedserve import request_slack, slack_score, time_out

from tests.cpu.policies.snapshots import req


def test_slack_is_deadline_less_elapsed_less_predicted_over_standalone():
    # SLO 10 s, 3 s since arrival, 4 s predicted left, 2 s alone: (10 - 3 - 4) / 2.
    assert slack_score(10.0, 3.0, 4.0, 2.0) == 1.5
    # The same margin on a request twice as long alone is half as much slack.
    assert slack_score(10.0, 3.0, 4.0, 4.0) == 0.75
    # Predicted to miss: below zero, by the missed seconds over the standalone latency.
    assert slack_score(10.0, 7.0, 4.0, 2.0) == -0.5
    assert slack_score(10.0, 6.0, 4.0, 2.0) == 0.0


def test_a_request_without_a_deadline_has_infinite_slack():
    assert slack_score(math.inf, 100.0, 50.0, 1.0) == math.inf


@pytest.mark.parametrize("standalone", [0.0, -1.0, math.nan])
def test_standalone_latency_must_be_positive(standalone):
    with pytest.raises(ValueError, match="standalone"):
        slack_score(10.0, 0.0, 1.0, standalone)


def test_a_views_slack_reads_its_absolute_deadline_and_arrival():
    view = req("r", arrival=2.0, deadline=12.0)  # DDL 10 s from its arrival
    # At t = 5: C = 3 s; P = 4 s, SA = 2 s: the same 1.5 as above.
    assert request_slack(view, 5.0, 4.0, 2.0) == pytest.approx(1.5)
    assert request_slack(view, 5.0, 4.0, 2.0) == pytest.approx((view.deadline - 5.0 - 4.0) / 2.0)


def test_time_out_is_finishing_after_the_deadline():
    view = req("r", deadline=10.0)
    assert not time_out(view, 6.0, 4.0)  # ends exactly at the deadline: on time
    assert time_out(view, 6.0, 4.0001)
    assert not time_out(req("r"), 1e9, 1e9)  # no deadline: never times out
