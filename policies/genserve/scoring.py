"""The per-request SLO score the round maximises (GenServe §4.4: max sum of z_r).

The paper scores a candidate by whether its request is still "recoverable" and by an SLO score
f(c), and compares plans lexicographically (Algorithm 1, line 13). Ours, per request r:

1. met: z_r = 1 when r is predicted to meet D_r. A request that steps this round is predicted
   to finish at now + its remaining time at this round's allocation; a request left out waits
   one round (Delta_round) and then gets its best allocation. A running request is met when
   either holds, since stepping now is never worse than waiting (this keeps the solver from
   idling a worker because "waiting and then running fast" looked better than "running slow").
2. urgency: sum, over requests that step this round, of the slack weight 1/(1 + slack_r),
   slack_r = D_r - now - (remaining time at the best allocation). This is what ranks victims:
   least slack weighs most and keeps running; the video with most slack is the one that gives
   way to urgent images (§4.2, Fig. 8). Any request, even a late one, weighs > 0, so a free
   worker is never left idle while work waits ("resume when the GPU is idle").
3. -sum of w_r * predicted remaining time: among plans that serve the same requests, spend
   spare workers where they shorten the most urgent work (upgrade SP when GPUs are idle,
   downgrade the most relaxed video when they are scarce, §4.3).

A request that can no longer make its deadline gets the smallest weight: it is served, but
only with what nobody else can use. A worker kept free for an image expected to arrive (the
composed policy's headroom: `RoundInput.reserve`) weighs less still, RESERVE_WEIGHT in the
urgency term: it beats only shortening work (an SP upgrade), never serving or keeping a request.

All terms are integers (micro-units), so plan scores add up the same in any order and ties break
deterministically.
"""

from __future__ import annotations

import math

SCALE = 1_000_000  # weights and seconds are counted in millionths
MAX_SECONDS = 1e9  # caps "never" (an unrunnable shape) so it still fits an integer score
LATE_WEIGHT = 2
RESERVE_WEIGHT = 1  # below any request's weight: see the docstring

Value = tuple[int, int, int]
ZERO: Value = (0, 0, 0)


def slack_weight(slack_s: float) -> int:
    """1 / (1 + slack) in millionths; the minimum for a request that is already late."""
    # Negative or NaN: late; inf: no SLO at all. Written as one comparison chain: this runs for
    # every request in every round.
    if 0.0 <= slack_s < math.inf:
        weight = round(SCALE / (1.0 + slack_s))
        return weight if weight > LATE_WEIGHT else LATE_WEIGHT
    return LATE_WEIGHT


def micros(seconds: float) -> int:
    return round((seconds if seconds < MAX_SECONDS else MAX_SECONDS) * SCALE)


def add(a: Value, b: Value) -> Value:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def run_value(deadline: float, now: float, run_s: float, best_s: float, round_s: float,
              weight: int | None = None) -> Value:
    """A request that steps this round and needs `run_s` more seconds at this allocation.

    `best_s` is its remaining time at the best allocation it could get (solo image, fastest
    SP degree); it sets the slack weight and the "still recoverable after one round" test.
    Pass `weight` when it is already known (it depends on `best_s` only).
    """
    if weight is None:
        weight = slack_weight(deadline - now - best_s)
    # Same association as wait_value, so "recoverable" is one number for both.
    met = now + run_s <= deadline or now + (round_s + best_s) <= deadline
    return (1 if met else 0, weight, -weight * micros(run_s))


def wait_value(deadline: float, now: float, best_s: float, round_s: float, weight: int | None = None) -> Value:
    """A request left out of this round: it starts at the next decision, at its best."""
    if weight is None:
        weight = slack_weight(deadline - now - best_s)
    wait_s = round_s + best_s
    return (1 if now + wait_s <= deadline else 0, 0, -weight * micros(wait_s))
