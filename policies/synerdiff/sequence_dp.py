"""SynerDiff's threshold-aware sequence planner (§III-D, problem P Eq. 3a-3f, Algorithm 1).

M UNet tasks (each takes exactly one denoising step in the sequence) and N VAE tasks (decodes
waiting to run) are split into stages (m_t, n_t, k_t), each a round the offline table measured:

    min  J = sum over VAE tasks of V(t),   V(t) = sum_{s<t} tau(s) + delta(t)      Eq. 3a-3b
    s.t. sum m_t = M, sum n_t = N                                                    Eq. 3c
         0 <= n_t <= m_t, 0 <= k_t <= m_t                                            Eq. 3d
         sum k_t <= K   (K: the UNet tasks past s_min, skip_cfg.py)                  Eq. 3e
         sum tau(t) <= (1 + alpha) * tau(M, N, min(K, M))                            Eq. 3f

J drops Eq. 3a's 1/N and its U_i - A_i terms: both are constants of the tasks, not of S.
The reference of Eq. 3f is the coarse plan, everything in one round, which the table must hold
(M <= B_max); it is the "throughput plateau" the finer sequences may exceed by at most alpha.

Algorithm 1 walks states (i, j, u) = (UNet, VAE, skip-CFG tasks done) from (0, 0, 0) to
(M, N, u), each transition one profiled round that fits, pruning transitions past T_lim. As
printed it keeps one <cost, time> label per state, the cheapest. That is not optimal: a
state's future cost depends on its time (every later decode waits for it, and Eq. 3f's budget
is spent by it), so a dearer but earlier label can lead to the better plan
(tests/cpu/policies/synerdiff/test_sequence_dp.py has a table where it does). Here each state
keeps its Pareto front of labels instead, which makes the DP exact:

    label A dominates B when cost_A <= cost_B, time_A <= time_B, rounds_A <= rounds_B, and
    (rounds_A < rounds_B or path_A <= path_B)

The final cost is non-decreasing in both cost and time (each later decode adds n * (time +
delta)) and the time cap is monotone too, so a dominated label never leads to a plan better
than its dominator's; the time, the round count and the path also break ties, the same way every
time: least cost, then least time (the throughput the paper keeps on its plateau), then fewest
rounds, then the lexicographically smallest sequence of (m, n, k). States are visited in
lexicographic order, which is topological because every transition adds a UNet task (or, when
M = 0, a VAE task). Labels are pruned against T_lim minus the least time the remaining tasks
need (a relaxation that ignores the skip-CFG budget, so it never prunes a feasible plan). The
fronts stay small: with B_max = 8 and every (m, n <= m, k <= m) row, M = N = K = 8 keeps a few
labels a state and plans in ~2 ms of CPython at alpha = 0.1 and under ~10 ms at any alpha;
smaller problems take well under 1 ms.

The time tie-break matters when N = 0: every plan then costs 0, so the plan is the fastest, and
every eligible task skips CFG where skipping makes the round faster. Which tasks are eligible
is the quality threshold's business (`skip_cfg.py`; the feedback controller lowers it under
load): within it, skip-CFG is spent for throughput.

M = 0 (only decodes waiting): Eq. 3d would forbid every round, so then the rounds are the
table's (0, n, 0) rows. If no sequence is feasible (with alpha >= 0 that happens only when
N > M > 0, which Eq. 3d rules out) the plan is the coarse round itself, which the profiler
measured and the executor can run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from stepserve.policies.synerdiff.checks import check_int, check_number
from stepserve.policies.synerdiff.types import ConcurrencyTable, Round, SequencePlan

# Latencies are sums of measured floats: a sequence that meets Eq. 3f exactly on paper must not
# fail it by a rounding error.
_SLACK = 1e-9

# A label: (cost, time, rounds, path), path a tuple of (m, n, k) triples (cheaper to compare
# than Round objects; the same order).
_Label = tuple[float, float, int, tuple[tuple[int, int, int], ...]]


def time_limit(unet: int, vae: int, skippable: int, table: ConcurrencyTable, alpha: float) -> float:
    """T_lim of Eq. 3f, the cap on a sequence's seconds (with the rounding slack)."""
    reference = Round(unet, vae, min(skippable, unet))
    if not table.has(reference):
        raise ValueError(f"plan_sequence: the coarse round {reference} that Eq. 3f is measured against is not "
                         f"in the c={table.chunks} table (B_max={table.max_batch})")
    return (1.0 + alpha) * table.tau(reference) * (1.0 + _SLACK)


def plan_sequence(unet: int, vae: int, skippable: int, table: ConcurrencyTable, alpha: float) -> SequencePlan:
    """The optimal sequence for `unet` one-step UNet tasks, `vae` decodes and `skippable` UNet
    tasks eligible for skip-CFG, under throughput slack `alpha` (the paper uses 0.1)."""
    for name, value in (("unet", unet), ("vae", vae), ("skippable", skippable)):
        check_int("plan_sequence", name, value, 0)
    check_number("plan_sequence", "alpha", alpha, 0.0)
    if not isinstance(table, ConcurrencyTable):
        raise ValueError(f"plan_sequence: table must be a ConcurrencyTable, got {type(table).__name__}")
    if unet == 0 and vae == 0:
        return SequencePlan((), 0.0, 0.0)
    budget = min(skippable, unet)  # at most every stepping task skips
    limit = time_limit(unet, vae, skippable, table, alpha)

    # Grouped by (m, n), each group in increasing k, so a state looks only at rounds that fit.
    actions: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for r in table.rounds():
        if r.unet <= unet and r.vae <= vae and r.skip <= budget and (unet == 0 or r.vae <= r.unet):
            actions.setdefault((r.unet, r.vae), []).append((r.skip, table.tau(r), table.delta(r)))
    rest = _least_time_to_finish(unet, vae, actions)
    fronts: dict[tuple[int, int, int], list[_Label]] = {(0, 0, 0): [(0.0, 0.0, 0, ())]}
    for state in itertools.product(range(unet + 1), range(vae + 1), range(budget + 1)):
        front = fronts.get(state)
        if not front:
            continue
        i, j, u = state
        for (m, n), group in actions.items():
            if i + m > unet or j + n > vae:
                continue
            for k, tau, delta in group:
                if u + k > budget:
                    break
                target = fronts.setdefault((i + m, j + n, u + k), [])
                # Eq. 3f, looking ahead: a label that cannot finish within the cap is dropped now.
                bound = limit - rest[i + m][j + n]
                for cost, time, count, path in front:
                    end = time + tau
                    if end > bound:
                        continue
                    _insert(target, (cost + n * (time + delta), end, count + 1, path + ((m, n, k),)))

    goals = [label for u in range(budget + 1) for label in fronts.get((unet, vae, u), ())]
    if not goals:
        coarse = Round(unet, vae, budget)
        return SequencePlan((coarse,), vae * table.delta(coarse), table.tau(coarse))
    cost, time, _, path = min(goals, key=lambda label: (label[0], label[1], label[2], label[3]))
    return SequencePlan(tuple(Round(*r) for r in path), cost, time)


def _least_time_to_finish(unet: int, vae: int, actions: dict[tuple[int, int], list[tuple[int, float, float]]]
                          ) -> list[list[float]]:
    """rest[i][j]: the least time any sequence of `actions` takes from i UNet and j VAE tasks done
    to all done, ignoring the skip-CFG budget (so it never overestimates); inf if none can."""
    rest = [[math.inf] * (vae + 1) for _ in range(unet + 1)]
    rest[unet][vae] = 0.0
    fastest = {mn: min(tau for _, tau, _ in group) for mn, group in actions.items()}
    for i in range(unet, -1, -1):
        for j in range(vae, -1, -1):
            for (m, n), tau in fastest.items():
                if i + m <= unet and j + n <= vae and (m or n):
                    rest[i][j] = min(rest[i][j], tau + rest[i + m][j + n])
    return rest


def _dominates(a: _Label, b: _Label) -> bool:
    """Every continuation of `a` is at least as good as the same continuation of `b`."""
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and (a[2] < b[2] or a[3] <= b[3])


def _insert(front: list[_Label], label: _Label) -> None:
    for other in front:
        if _dominates(other, label):
            return
    front[:] = [other for other in front if not _dominates(label, other)]
    front.append(label)


def assign(plan: SequencePlan, unet_ids: Sequence[str], skippable_ids: Sequence[str],
           vae_ids: Sequence[str]) -> tuple[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...]:
    """The task mapping E of a plan: per round (UNet ids, the ones of them that skip CFG, VAE ids).

    VAE tasks go to the earliest rounds in the order given (oldest first: they have waited
    longest). The first `plan.skip` of `skippable_ids` skip, each in a round that skips; the
    other UNet tasks fill the remaining places in the order of `unet_ids`. Within a round the
    UNet ids keep the order of `unet_ids`.
    """
    if not isinstance(plan, SequencePlan):
        raise ValueError(f"assign: plan must be a SequencePlan, got {type(plan).__name__}")
    unet_ids, skippable_ids, vae_ids = tuple(unet_ids), tuple(skippable_ids), tuple(vae_ids)
    for name, ids in (("unet_ids", unet_ids), ("skippable_ids", skippable_ids), ("vae_ids", vae_ids)):
        if len(set(ids)) != len(ids):
            raise ValueError(f"assign: {name} has a repeated id: {ids}")
    if len(unet_ids) != plan.unet:
        raise ValueError(f"assign: the plan steps {plan.unet} UNet tasks, got {len(unet_ids)} unet_ids")
    if len(vae_ids) != plan.vae:
        raise ValueError(f"assign: the plan decodes {plan.vae} VAE tasks, got {len(vae_ids)} vae_ids")
    stray = set(skippable_ids) - set(unet_ids)
    if stray:
        raise ValueError(f"assign: skippable ids {sorted(stray)} are not UNet tasks of this sequence")
    if len(skippable_ids) < plan.skip:
        raise ValueError(f"assign: the plan skips CFG for {plan.skip} tasks, only {len(skippable_ids)} are eligible")
    both = set(unet_ids) & set(vae_ids)
    if both:
        raise ValueError(f"assign: ids {sorted(both)} are both denoising and decoding")

    skipping = list(skippable_ids[:plan.skip])
    chosen = set(skipping)
    others = [task for task in unet_ids if task not in chosen]
    decodes = list(vae_ids)
    mapping = []
    for r in plan.rounds:
        skips = tuple(skipping[:r.skip])
        del skipping[:r.skip]
        members = set(skips) | set(others[:r.unet - r.skip])
        del others[:r.unet - r.skip]
        mapping.append((tuple(task for task in unet_ids if task in members), skips, tuple(decodes[:r.vae])))
        del decodes[:r.vae]
    return tuple(mapping)
