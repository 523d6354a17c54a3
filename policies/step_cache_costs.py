"""What step caching (`RequestSpec.step_cache`, the First-Block Cache of `engine.step_cache`)
saves a forward, for the cost model: every row runs the first block; the rows of a request that
skips this step leave before the later blocks. So a forward whose rows skip with share s costs
`HEAD_SHARE + (1 - HEAD_SHARE) * (1 - s)` of the full forward, and a request caching at
threshold t skips a share `expected_skip_share(t)` of its steps (first_block's shares; TaylorSeer,
whose extrapolated steps move its first block more, skips fewer: 34%, 52%, 59% at 0.1, 0.2, 0.3).

Both are measured by `load_tests/bench_step_cache` on the shapes model (20 steps; its report,
docs/results/step-cache/step_cache.json, holds the figures below): the share of steps skipped at
each threshold (0.05 from an earlier run of it: nothing skips there), and the share of a UNet
forward its head (embeddings, `conv_in`, the first ResNet) takes. Every model is priced with
these for now (a DiT's head is one block of its 24: less, so there they err on the side of a
dearer step; per-model rows in the profile would replace them).
"""

from __future__ import annotations

# (threshold, share of a request's steps that skip), in increasing thresholds.
SKIP_SHARE = ((0.0, 0.0), (0.05, 0.0), (0.1, 0.35), (0.2, 0.59), (0.3, 0.69))
HEAD_SHARE = 0.07  # (0.064 and 0.068 in two runs)


def expected_skip_share(threshold: float) -> float:
    """The share of its steps a request caching at `threshold` skips (linear between the
    measured thresholds, the last share beyond them)."""
    if threshold <= 0:
        return 0.0
    for (t0, s0), (t1, s1) in zip(SKIP_SHARE, SKIP_SHARE[1:]):
        if threshold <= t1:
            return s0 + (s1 - s0) * (threshold - t0) / (t1 - t0)
    return SKIP_SHARE[-1][1]


def cached_forward_share(skip_share: float) -> float:
    """The share of a full forward's time a forward costs whose rows skip with `skip_share`."""
    return HEAD_SHARE + (1.0 - HEAD_SHARE) * (1.0 - skip_share)
