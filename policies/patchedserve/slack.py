"""PatchedServe's slack score and SLO-violation test (patchedserve.txt §6.2, Algorithm 1).

    Slack_i = (DDL_i - C_i - P_i) / SA_i

DDL_i is request i's SLO (seconds from its arrival), C_i the time since it arrived, P_i the
predicted time of its remaining stages and SA_i its standalone latency (alone on an idle
worker). Lower is more urgent; below zero it is predicted to miss. Dividing by SA_i makes a
512 px and a 1024 px request comparable: slack is counted in units of the request's own solo
run, so a long request is not urgent merely because its numbers are large.

In stepserve the scheduler acts on denoising steps, and a `RequestView`'s deadline is absolute
and already ends before the decode and response (the router plans denoising to end that much
early: `RouterCore.submit`'s tail). So DDL_i - C_i is `deadline - now`, and P_i and SA_i count
denoising steps: P_i the steps left at the predicted pace, SA_i all its steps alone.
"""

from __future__ import annotations

import math

from stepserve.policies.types import RequestView


def slack_score(ddl_s: float, elapsed_s: float, predicted_s: float, standalone_s: float) -> float:
    """(DDL - C - P) / SA, the paper's formula; +inf for a request without a deadline."""
    if not standalone_s > 0:
        raise ValueError(f"standalone latency must be > 0, got {standalone_s!r}")
    if math.isinf(ddl_s):
        return math.inf
    return (ddl_s - elapsed_s - predicted_s) / standalone_s


def request_slack(view: RequestView, now: float, predicted_s: float, standalone_s: float) -> float:
    """The slack of `view` at `now`, its remaining steps predicted to take `predicted_s` and all
    its steps `standalone_s` alone."""
    return slack_score(view.deadline - view.arrival_time, now - view.arrival_time, predicted_s, standalone_s)


def time_out(view: RequestView, now: float, predicted_s: float) -> bool:
    """Algorithm 1's `time_out(task, pred_latency)`: its remaining steps, started now and taking
    `predicted_s`, end after its deadline (slack below zero)."""
    return now + predicted_s > view.deadline
