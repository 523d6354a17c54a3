"""Stages 2-3: knapsack DP over video groups, combined with the image plan (GenServe
Algorithm 1, lines 6-16).

dp[j][b] is the best score of the first j videos using exactly b workers; each video picks one
candidate whose weight is its SP degree (0 for pause/wait). Each terminal budget b leaves
N - b workers to images, priced by the EDF image plan, and the best sum wins. O(V * N * K).

The paper's DP also checks "no GPU overlap with previous selections". Workers are
interchangeable here (moving a video costs nothing), so a plan is feasible exactly when its
degrees fit in N, the DP over counts is exact, and materialize.py picks the concrete workers.
Scores are integer triples compared lexicographically; on exact ties the earlier option wins
(smaller budget, then candidate order, which puts a video's current choice first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepserve.policies.genserve.candidates import VideoOptions
from stepserve.policies.genserve.image_batching import ImagePlan
from stepserve.policies.genserve.scoring import Value, add


@dataclass(frozen=True)
class KnapsackSolution:
    choices: tuple[int, ...]  # per video (in the order given), the index of its chosen candidate
    image_workers: int  # g_free: workers left to images (the first g batches run)
    value: Value


# Scores are packed into one int, met << 160 | urgency << 100 | remaining term, so the inner
# loop adds and compares machine-sized ints instead of building tuples; the order is exactly
# the lexicographic order of the triples while |remaining term| < 2**99 and urgency < 2**59
# (scoring.py caps one request's terms at 1e6 * 1e15 ~ 2**70 and 1e6 ~ 2**20).
_MET_SHIFT = 160
_URGENCY_SHIFT = 100


def _pack(value: Value) -> int:
    return (value[0] << _MET_SHIFT) + (value[1] << _URGENCY_SHIFT) + value[2]


def solve_knapsack(options: Sequence[VideoOptions], images: ImagePlan, n_workers: int) -> KnapsackSolution:
    layer: list[int | None] = [None] * (n_workers + 1)
    layer[0] = 0
    reachable = [0]  # budgets with a value, ascending: skips the dead states cheaply
    backs: list[list[tuple[int, int]]] = []  # per video: budget -> (previous budget, candidate)
    for option in options:
        weighted = [(ci, c.degree, _pack(c.value)) for ci, c in enumerate(option.candidates)]
        new: list[int | None] = [None] * (n_workers + 1)
        back: list[tuple[int, int]] = [(-1, -1)] * (n_workers + 1)
        for b in reachable:
            base = layer[b]
            for ci, w, v in weighted:
                nb = b + w
                if nb > n_workers:
                    continue
                s = base + v  # type: ignore[operator]
                cur = new[nb]
                if cur is None or s > cur:
                    new[nb] = s
                    back[nb] = (b, ci)
        layer = new
        # Keep only budgets that beat every smaller budget: a state that uses more workers for
        # no more score can be matched by the smaller one in every later layer and leaves
        # fewer workers to images (whose value only grows with workers), so dropping it keeps
        # the DP exact. This bounds the work on large clusters (64 workers) by the frontier.
        reachable = []
        frontier: int | None = None
        for b in range(n_workers + 1):
            v = new[b]
            if v is not None and (frontier is None or v > frontier):
                reachable.append(b)
                frontier = v
        backs.append(back)
        if not reachable:
            raise ValueError("no feasible allocation: running videos need more workers than the round has")

    best: int | None = None
    best_b = -1
    for b in reachable:
        s = layer[b] + _pack(images.value(n_workers - b))  # type: ignore[operator]
        if best is None or s > best:
            best, best_b = s, b

    choices = [0] * len(options)
    b = best_b
    for j in range(len(options) - 1, -1, -1):
        b, choices[j] = backs[j][b]
    assert b == 0
    total = images.value(n_workers - best_b)
    for option, ci in zip(options, choices):
        total = add(total, option.candidates[ci].value)
    return KnapsackSolution(tuple(choices), n_workers - best_b, total)
