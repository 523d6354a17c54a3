"""The per-request score (scoring.py), worked by hand, and cost memoization."""

from __future__ import annotations

import math

from stepserve.policies.genserve import GenServeConfig, MemoizedCosts, RoundInput, decide_round
from stepserve.policies.genserve.scoring import LATE_WEIGHT, micros, run_value, slack_weight, wait_value

from tests.cpu.policies.genserve.fakes import FakeCosts, img, vid, workers


def test_slack_weight():
    assert slack_weight(0.0) == 1_000_000
    assert slack_weight(1.0) == 500_000
    assert slack_weight(9.0) == 100_000
    assert slack_weight(-0.1) == LATE_WEIGHT
    assert slack_weight(math.nan) == LATE_WEIGHT
    assert slack_weight(math.inf) == LATE_WEIGHT  # no SLO: nothing to protect
    assert slack_weight(1e12) == LATE_WEIGHT  # never below the late weight


def test_run_and_wait_values():
    # 10 s of work at the best allocation, deadline in 15 s: slack 5 s, weight 1/6.
    w = round(1e6 / 6)
    assert wait_value(15.0, 0.0, 10.0, 1.0) == (1, 0, -w * micros(11.0))
    assert wait_value(15.0, 0.0, 10.0, 6.0) == (0, 0, -w * micros(16.0))  # a round too long to wait
    assert run_value(15.0, 0.0, 12.0, 10.0, 1.0) == (1, w, -w * micros(12.0))
    # Too slow to finish at this allocation, but still recoverable after one round at the best.
    assert run_value(15.0, 0.0, 20.0, 10.0, 1.0)[0] == 1
    # Too slow and not recoverable.
    assert run_value(15.0, 0.0, 20.0, 10.0, 6.0)[0] == 0
    assert run_value(15.0, 0.0, 14.0, 10.0, 6.0)[0] == 1
    assert micros(math.inf) == micros(1e9)


def test_running_never_scores_below_waiting():
    for deadline in (-5.0, 0.5, 3.0, 11.0, 12.0, 100.0, math.inf):
        for run_s in (1.0, 10.0, 50.0):
            assert run_value(deadline, 0.0, run_s, 10.0, 1.0)[:2] > wait_value(deadline, 0.0, 10.0, 1.0)[:2]


def test_a_kept_memo_answers_repeated_rounds_without_the_cost_model():
    fake = FakeCosts()
    costs = MemoizedCosts(fake)
    inp = RoundInput(0.0, workers(8), images=(img("a", 5.0), img("b", 5.0)), videos=(vid("v", 100.0, on=workers(8)),))
    config = GenServeConfig()
    first = decide_round(inp, config, costs)
    calls = fake.calls
    assert calls > 0
    assert decide_round(inp, config, costs) == first
    assert fake.calls == calls
