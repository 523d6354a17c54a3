"""Algorithm 1 and the other ways of loading cached activations, against a brute-force oracle
that tries all 2^N choices of which blocks load under the same timing recurrence."""

from __future__ import annotations

import itertools
import random

import pytest

from stepserve.policies.instgenie.pipeline_dp import (
    Loading,
    algorithm1,
    always_load,
    ideal,
    naive,
    optimal,
    pipeline_latency,
    plan,
)


def oracle(cw, cwo, lm):
    """The least latency over every choice, written without the module's recurrence helper."""
    best = None
    for choice in itertools.product((False, True), repeat=len(cw)):
        loaded = done = 0.0
        for use, w, wo, load in zip(choice, cw, cwo, lm):
            if use:
                loaded += load
                done = max(loaded, done) + w
            else:
                done += wo
        best = done if best is None else min(best, done)
    return best


def random_blocks(rng, n, uniform):
    if uniform:
        w = rng.uniform(0, 4)
        return [w] * n, [w + rng.uniform(0, 6)] * n, [rng.uniform(0, 8)] * n
    cw = [rng.uniform(0, 4) for _ in range(n)]
    return cw, [w + rng.uniform(0, 6) for w in cw], [rng.uniform(0, 8) for _ in range(n)]


@pytest.mark.parametrize("uniform", [True, False])
def test_optimal_matches_the_oracle_and_algorithm1_never_beats_it(uniform):
    rng = random.Random(7)
    gaps = 0
    for _ in range(400):
        n = rng.randint(0, 8)
        cw, cwo, lm = random_blocks(rng, n, uniform)
        best = oracle(cw, cwo, lm)
        exact, greedy = optimal(n, cw, cwo, lm), algorithm1(n, cw, cwo, lm)
        assert exact.latency == pytest.approx(best, abs=1e-9)
        # Each answer's latency is what its own choice costs under the recurrence.
        assert pipeline_latency(exact.use_cache, cw, cwo, lm) == pytest.approx(exact.latency, abs=1e-9)
        assert pipeline_latency(greedy.use_cache, cw, cwo, lm) == pytest.approx(greedy.latency, abs=1e-9)
        assert greedy.latency >= best - 1e-9
        # Algorithm 1 is never worse than loading every block or computing every block in full.
        assert greedy.latency <= always_load(n, cw, cwo, lm).latency + 1e-9
        assert greedy.latency <= sum(cwo) + 1e-9
        assert ideal(n, cw, cwo, lm).latency <= best + 1e-9
        assert always_load(n, cw, cwo, lm).latency <= naive(n, cw, cwo, lm).latency + 1e-9
        gaps += greedy.latency > best + 1e-9
    assert gaps > 0  # Algorithm 1 is a greedy pass: on random costs it misses the optimum sometimes


def test_algorithm1_line_by_line_on_fig9_bottom():
    """Loads slower than compute at first: the first two blocks compute in full while the third's
    activations load behind them (Fig. 9-bottom)."""
    result = algorithm1(3, 1.0, 2.0, 3.5)
    # block 0: max(3.5, 0) + 1 = 4.5 > 0 + 2 -> compute (2); block 1: max(3.5, 2) + 1 = 4.5 > 4 -> compute (4)
    # block 2: max(3.5, 4) + 1 = 5 <= 6 -> load (5)
    assert result.use_cache == (False, False, True)
    assert result.latency == pytest.approx(5.0)


def test_algorithm1_is_greedy_not_optimal():
    """Loading a block delays every later load, which Algorithm 1 never weighs."""
    assert algorithm1(2, 0.0, 11.0, 10.0).latency == pytest.approx(20.0)
    best = optimal(2, 0.0, 11.0, 10.0)
    assert best.use_cache == (False, True) and best.latency == pytest.approx(11.0)


def test_naive_is_load_then_compute_and_ideal_is_free_loading():
    cw, cwo, lm = [1.0, 2.0], [3.0, 4.0], [0.5, 0.25]
    assert naive(2, cw, cwo, lm).latency == pytest.approx(3.75)
    assert ideal(2, cw, cwo, lm).latency == pytest.approx(3.0)
    # Pipelined, only the first load is a bubble: the second hides behind the first block.
    assert always_load(2, cw, cwo, lm).latency == pytest.approx(3.5)


def test_numbers_stand_for_every_block_and_plan_dispatches_by_name():
    assert algorithm1(4, 1.0, 2.0, 1.5) == algorithm1(4, [1.0] * 4, [2.0] * 4, [1.5] * 4)
    for loading in Loading:
        assert plan(loading.value, 4, 1.0, 2.0, 1.5) == plan(loading, 4, [1.0] * 4, [2.0] * 4, [1.5] * 4)
    assert plan(Loading.ALGORITHM1, 0, 1.0, 2.0, 1.5).latency == 0.0


@pytest.mark.parametrize("bad", [dict(n=-1), dict(c_with=[1.0]), dict(load=[1.0, -1.0]), dict(c_without=float("nan"))])
def test_bad_inputs_say_what_is_wrong(bad):
    args = dict(n=2, c_with=1.0, c_without=2.0, load=1.0) | bad
    with pytest.raises(ValueError):
        algorithm1(**args)
