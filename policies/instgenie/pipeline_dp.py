"""Loading cached activations beside the computation that needs them (InstGenIE §4.2, Fig. 9).

A forward with cached activations runs its transformer blocks in order on a compute stream
while a load stream copies each block's cached activations (the unmasked tokens' outputs) from
host memory to the GPU. Block i of the choice `use_cache` then follows one timing recurrence,
the one Algorithm 1 is written in (`pipeline_latency`):

    loaded  <- loaded + L_i                          (its load starts when the previous load ends)
    done    <- max(loaded, done) + C_w,i             if it uses its cache
    done    <- done + C_wo,i                         if it computes every token instead

C_w,i: the block's compute with cached activations (at the batch's mask ratio); C_wo,i: without
any (every token); L_i: loading its cached activations. Everything here takes them as numbers
(one for every block) or as per-block sequences, and returns a `Pipeline`.

The ways of running a forward that the paper compares (Fig. 4-left, Fig. 9):

- `naive` (Fig. 9-top, Fig. 4-left "Naive"): load, then compute, never both at once: every
  block's activations are loaded before the computation that needs them starts, so the forward
  takes sum(L) + sum(C_w). The paper: +102% over ideal for SDXL on an H800 over PCIe Gen5.
- `always_load` (Fig. 9-middle, the strawman pipeline): every block uses its cache, loads
  pipelined with compute; bubbles where a load outlasts the previous block's compute.
- `algorithm1` (Fig. 9-bottom, Algorithm 1 exactly as printed): one pass over the blocks that
  uses a block's cache only if that makes the block end no later than computing it in full.
- `optimal`: the choice with the least latency under the same recurrence (exact). Algorithm 1
  is a greedy pass, not a search: it never looks at what a load costs the blocks after it (each
  load delays every later load). It is never worse than `always_load` or computing everything,
  and on realistic costs it is at or near the optimum; on some inputs it is not (two blocks with
  L = 10, C_w = 0, C_wo = 11: it loads both and ends at 20, computing the first in full ends at
  11). tests/cpu/policies/instgenie/test_pipeline_dp.py checks both against a brute-force oracle.
- `ideal` (Fig. 4-left "Ideal"): loading free, sum(C_w).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

Costs = float | Sequence[float]


@dataclass(frozen=True)
class Pipeline:
    """Which blocks use their cached activations, and when the last block's computation ends."""

    use_cache: tuple[bool, ...]
    latency: float


class Loading(str, Enum):
    """How a forward with cached activations loads them (see the module docstring)."""

    NAIVE = "naive"
    ALWAYS_LOAD = "always_load"
    ALGORITHM1 = "algorithm1"
    OPTIMAL = "optimal"
    IDEAL = "ideal"


def per_block(n: int, c_with: Costs, c_without: Costs, load: Costs) -> tuple[tuple[float, ...], ...]:
    """The three costs as one tuple per kind, `n` entries each (a number stands for every block)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the number of blocks must be an int >= 0, got {n!r}")
    out = []
    for name, costs in (("C_w", c_with), ("C_wo", c_without), ("L", load)):
        values = (float(costs),) * n if isinstance(costs, (int, float)) else tuple(float(c) for c in costs)
        if len(values) != n:
            raise ValueError(f"{name}: {len(values)} per-block costs for {n} blocks")
        if not all(v >= 0 for v in values):  # also refuses NaN
            raise ValueError(f"{name}: costs must be >= 0, got {values}")
        out.append(values)
    return tuple(out)


def pipeline_latency(use_cache: Sequence[bool], c_with: Costs, c_without: Costs, load: Costs) -> float:
    """When the last block ends under the choice `use_cache` (the recurrence above)."""
    cw, cwo, lm = per_block(len(use_cache), c_with, c_without, load)
    loaded = done = 0.0
    for i, use in enumerate(use_cache):
        if use:
            loaded += lm[i]
            done = max(loaded, done) + cw[i]
        else:
            done += cwo[i]
    return done


def algorithm1(n: int, c_with: Costs, c_without: Costs, load: Costs) -> Pipeline:
    """InstGenIE Algorithm 1, line for line (comp and load are its two arrays)."""
    cw, cwo, lm = per_block(n, c_with, c_without, load)
    comp = [0.0] * (n + 1)
    loaded = [0.0] * (n + 1)
    use_cache = [False] * n
    for i in range(1, n + 1):
        if max(loaded[i - 1] + lm[i - 1], comp[i - 1]) + cw[i - 1] <= comp[i - 1] + cwo[i - 1]:
            loaded[i] = loaded[i - 1] + lm[i - 1]
            comp[i] = max(loaded[i - 1] + lm[i - 1], comp[i - 1]) + cw[i - 1]
            use_cache[i - 1] = True
        else:
            loaded[i] = loaded[i - 1]
            comp[i] = comp[i - 1] + cwo[i - 1]
    return Pipeline(tuple(use_cache), comp[n])


def optimal(n: int, c_with: Costs, c_without: Costs, load: Costs) -> Pipeline:
    """The least latency over all 2^n choices, by dynamic programming over (loaded, done) pairs.

    Both the next `loaded` and the next `done` grow with the current ones, so a state no earlier
    in either than another can be dropped: only the Pareto front is kept, block by block. With
    equal loads its size stays <= blocks + 1 (states differ by how many loads they made).
    """
    cw, cwo, lm = per_block(n, c_with, c_without, load)
    front: list[tuple[float, float]] = [(0.0, 0.0)]  # (loaded, done), loaded rising, done falling
    history: list[list[tuple[int, bool]]] = []  # per block: (parent, used the cache) of each state
    for i in range(n):
        candidates = []
        for k, (loaded, done) in enumerate(front):
            candidates.append((loaded + lm[i], max(loaded + lm[i], done) + cw[i], k, True))
            candidates.append((loaded, done + cwo[i], k, False))
        candidates.sort(key=lambda c: (c[0], c[1]))
        front, links = [], []
        for loaded, done, parent, use in candidates:
            if not front or done < front[-1][1]:
                front.append((loaded, done))
                links.append((parent, use))
        history.append(links)
    latency = front[-1][1]  # the front's `done` falls as its `loaded` grows: the last is the least
    use_cache = [False] * n
    state = len(front) - 1
    for i in range(n - 1, -1, -1):
        state, use_cache[i] = history[i][state]
    return Pipeline(tuple(use_cache), latency)


def naive(n: int, c_with: Costs, c_without: Costs, load: Costs) -> Pipeline:
    """Every block's cached activations loaded, then the blocks computed with them: no overlap."""
    cw, _, lm = per_block(n, c_with, c_without, load)
    return Pipeline((True,) * n, sum(lm) + sum(cw))


def always_load(n: int, c_with: Costs, c_without: Costs, load: Costs) -> Pipeline:
    """Every block uses its cache, loads pipelined with compute (the strawman, with its bubbles)."""
    use_cache = (True,) * n
    return Pipeline(use_cache, pipeline_latency(use_cache, c_with, c_without, load))


def ideal(n: int, c_with: Costs, c_without: Costs, load: Costs) -> Pipeline:
    """Every block uses its cache and loading costs nothing: the bound the others are held to."""
    cw, _, _ = per_block(n, c_with, c_without, load)
    return Pipeline((True,) * n, sum(cw))


PLANNERS: dict[Loading, Callable[[int, Costs, Costs, Costs], Pipeline]] = {
    Loading.NAIVE: naive, Loading.ALWAYS_LOAD: always_load, Loading.ALGORITHM1: algorithm1,
    Loading.OPTIMAL: optimal, Loading.IDEAL: ideal,
}


def plan(loading: Loading, n: int, c_with: Costs, c_without: Costs, load: Costs) -> Pipeline:
    """The forward as `loading` runs it."""
    return PLANNERS[Loading(loading)](n, c_with, c_without, load)
