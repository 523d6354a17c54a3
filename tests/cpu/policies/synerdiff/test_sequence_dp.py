"""The sequence planner (problem P, Eq. 3) against a brute-force oracle, Algorithm 1 as printed,
and the paper's Table I.

The oracle enumerates every ordered sequence of profiled rounds that completes the M UNet and N
VAE tasks (M <= 4, N <= 3, K <= 2), keeps those within Eq. 3d-3f, and ranks them by the same
key the planner promises: least J, then least time, then fewest rounds, then the
lexicographically smallest sequence. Tables are random, with rounds missing, and on a dyadic grid in half the cases so
that sums are exact and ties are real.
"""

from __future__ import annotations

import itertools
import random

import pytest

from stepserve.policies.synerdiff import ConcurrencyTable, Round, SequencePlan, assign, plan_sequence, time_limit


def oracle(M, N, K, table, alpha):
    """(key, rounds, how many feasible sequences reach the least J) of the best feasible
    sequence, or None; written without the planner's DP."""
    K = min(K, M)
    limit = (1.0 + alpha) * table.tau(Round(M, N, K)) * (1.0 + 1e-9)
    rows = [r for r in table.rounds() if (r.vae <= r.unet if M > 0 else r.unet == 0)]
    feasible = []

    def walk(rounds, i, j, u, cost, time):
        if (i, j) == (M, N):
            if time <= limit:
                key = (cost, time, len(rounds), tuple((r.unet, r.vae, r.skip) for r in rounds))
                feasible.append((key, tuple(rounds)))
            return
        for r in rows:
            if i + r.unet <= M and j + r.vae <= N and u + r.skip <= K:
                walk(rounds + [r], i + r.unet, j + r.vae, u + r.skip,
                     cost + r.vae * (time + table.delta(r)), time + table.tau(r))

    walk([], 0, 0, 0, 0.0, 0.0)
    if not feasible:
        return None
    key, rounds = min(feasible)
    return key, rounds, sum(other[0] == key[0] for other, _ in feasible)


def eq3b_cost(plan, table):
    """J from Eq. 3b directly: V(t) = taus of the stages before t + delta of stage t."""
    return sum(r.vae * (sum(table.tau(p) for p in plan.rounds[:t]) + table.delta(r))
               for t, r in enumerate(plan.rounds))


def assert_feasible(plan, M, N, K, table, alpha):
    assert (plan.unet, plan.vae) == (M, N)  # Eq. 3c
    assert plan.skip <= min(K, M)  # Eq. 3e
    for r in plan.rounds:
        assert table.has(r)
        assert r.vae <= r.unet if M > 0 else r.unet == 0  # Eq. 3d (and the M = 0 case)
    assert plan.seconds == pytest.approx(sum(table.tau(r) for r in plan.rounds), abs=1e-12)
    assert plan.seconds <= time_limit(M, N, K, table, alpha)  # Eq. 3f
    assert plan.vae_cost == pytest.approx(eq3b_cost(plan, table), abs=1e-9)


def random_table(rng, grid):
    rows = {}
    keep_reference = rng.random() < 0.5
    for m, n in itertools.product(range(5), range(4)):
        for k in range(m + 1):
            if m == n == 0 or (rng.random() < 0.25 and not keep_reference):
                continue
            # Roughly increasing in m and n, a little faster when more tasks skip CFG. Rows with
            # n > m are kept: the planner must not use them while UNet tasks are stepping.
            tau = 0.1 + 0.08 * m + 0.1 * n - 0.02 * k + rng.uniform(0.0, 0.15)
            delta = rng.uniform(0.2, 1.0) * tau if n else 0.0
            if grid:
                tau = max(1, round(tau * 16)) / 16
                delta = min(tau, round(delta * 16) / 16) if n else 0.0
            rows[Round(m, n, k)] = (tau, delta)
    return ConcurrencyTable(rows, chunks=2, max_batch=4)


def test_dp_matches_brute_force():
    rng = random.Random(5)
    compared = split = ties = 0
    for case in range(800):
        table = random_table(rng, grid=case % 2 == 0)
        M, N, K = rng.randint(0, 4), rng.randint(0, 3), rng.randint(0, 2)
        alpha = rng.choice((0.0, 0.1, 0.3, 1.0, 5.0))
        if M == N == 0:
            assert plan_sequence(M, N, K, table, alpha) == SequencePlan((), 0.0, 0.0)
            continue
        if not table.has(Round(M, N, min(K, M))):
            with pytest.raises(ValueError, match="coarse round"):
                plan_sequence(M, N, K, table, alpha)
            continue
        plan = plan_sequence(M, N, K, table, alpha)
        best = oracle(M, N, K, table, alpha)
        if best is None:
            # Nothing satisfies Eq. 3d: more decodes than stepping tasks. The coarse round runs.
            assert N > M > 0
            coarse = Round(M, N, min(K, M))
            assert plan == SequencePlan((coarse,), N * table.delta(coarse), table.tau(coarse))
            continue
        assert_feasible(plan, M, N, K, table, alpha)
        assert plan.vae_cost == pytest.approx(best[0][0], abs=1e-9)
        assert plan.rounds == best[1]  # the same tie-break, so the same plan
        compared += 1
        split += len(plan.rounds) > 1
        ties += best[2] > 1
    # Guards the comparison itself: many cases, many of them not the trivial coarse round, and
    # many where several sequences reach the least J, so the tie-break is checked too.
    assert compared > 400 and split > 80 and ties > 80, (compared, split, ties)


def printed_algorithm1(M, N, K, table, alpha):
    """Algorithm 1 as printed: one <cost, time> label per state, replaced only by a cheaper one."""
    K = min(K, M)
    limit = time_limit(M, N, K, table, alpha)
    dp = {(0, 0, 0): (0.0, 0.0, ())}
    for state in itertools.product(range(M + 1), range(N + 1), range(K + 1)):
        if state not in dp:
            continue
        cost, time, path = dp[state]
        for r in table.rounds():
            target = (state[0] + r.unet, state[1] + r.vae, state[2] + r.skip)
            if target[0] > M or target[1] > N or target[2] > K or r.vae > r.unet:
                continue
            if time + table.tau(r) <= limit:
                new = cost + r.vae * (time + table.delta(r))
                if target not in dp or new < dp[target][0]:
                    dp[target] = (new, time + table.tau(r), path + (r,))
    return min(dp[(M, N, u)] for u in range(K + 1) if (M, N, u) in dp)


# tau grows sub-linearly with the round; delta is when the round's decodes are done. Dyadic, so
# the costs below are exact.
PARETO_TABLE = ConcurrencyTable({
    Round(1, 1, 0): (0.75, 0.5),
    Round(2, 2, 0): (1.0, 1.0),
    Round(3, 3, 0): (1.5, 1.5),
}, chunks=1, max_batch=3)


@pytest.mark.parametrize("alpha, printed_cost", [(1.0, 3.75), (0.2, 4.0)])
def test_one_label_per_state_is_not_optimal(alpha, printed_cost):
    # State (2, 2, 0) is reached by [(2,2,0)] at cost 2.0, time 1.0 or by [(1,1,0), (1,1,0)] at
    # cost 0.5 + 1.25 = 1.75, time 1.5. The printed algorithm keeps the cheaper one, so the last
    # decode waits until 1.5: [(1,1,0)] * 3 costs 3.75. The earlier label wins: [(2,2,0), (1,1,0)]
    # costs 2.0 + 1.5 = 3.5. With alpha = 0.2 (cap 1.8 s) the kept label cannot even finish in time
    # (2.25 s), and the printed algorithm falls back to [(1,1,0), (2,2,0)] at 0.5 + 2 * 1.75 = 4.0.
    plan = plan_sequence(3, 3, 0, PARETO_TABLE, alpha)
    assert plan.rounds == (Round(2, 2, 0), Round(1, 1, 0))
    assert (plan.vae_cost, plan.seconds) == (3.5, 1.75)
    assert printed_algorithm1(3, 3, 0, PARETO_TABLE, alpha)[0] == printed_cost


# Table I rebuilt: rounds of m UNet tasks beside m decodes. tau(m, m) and delta(m, m) (ms) solve
# the paper's UNet- and VAE-latency rows for its six schedules (Table I gives exactly six numbers
# for each of the six unknowns, so the rows below reproduce it by construction).
TABLE_I_ROWS = {1: (46.3, 9.05), 2: (85.4, 20.95), 3: (124.5, 111.05), 4: (160.1, 133.7), 5: (203.9, 178.21),
                6: (237.9, 204.2)}
TABLE_I = ConcurrencyTable({Round(m, m, 0): (t / 1000, d / 1000) for m, (t, d) in TABLE_I_ROWS.items()},
                           chunks=1, max_batch=6)
TABLE_I_SCHEDULES = {(6,): (237.9, 204.2), (1, 5): (250.2, 188.6), (3, 3): (249.0, 173.3),
                     (1, 1, 4): (252.7, 161.6), (1, 2, 3): (256.2, 145.3), (1,) * 6: (277.8, 124.8)}


def schedule_plan(sizes):
    rounds = tuple(Round(m, m, 0) for m in sizes)
    seconds = sum(TABLE_I.tau(r) for r in rounds)
    return SequencePlan(rounds, eq3b_cost(SequencePlan(rounds, 0.0, 0.0), TABLE_I), seconds)


def test_table_one_finer_stages_trade_unet_time_for_vae_latency():
    for sizes, (unet_ms, vae_ms) in TABLE_I_SCHEDULES.items():
        plan = schedule_plan(sizes)
        assert plan.seconds * 1000 == pytest.approx(unet_ms, abs=0.01)
        assert plan.vae_cost / 6 * 1000 == pytest.approx(vae_ms, abs=0.01)
    # alpha = 0 admits only the coarse round; each larger alpha admits finer sequences, never a
    # worse one, and the planner beats every listed schedule within its cap.
    assert plan_sequence(6, 6, 0, TABLE_I, 0.0).rounds == (Round(6, 6, 0),)
    previous = None
    for alpha in (0.0, 0.05, 0.1, 0.2):
        plan = plan_sequence(6, 6, 0, TABLE_I, alpha)
        assert plan.seconds <= time_limit(6, 6, 0, TABLE_I, alpha)
        for sizes in TABLE_I_SCHEDULES:
            listed = schedule_plan(sizes)
            if listed.seconds <= time_limit(6, 6, 0, TABLE_I, alpha):
                assert plan.vae_cost <= listed.vae_cost + 1e-12
        assert previous is None or plan.vae_cost <= previous
        previous = plan.vae_cost
    assert previous < schedule_plan((6,)).vae_cost


def test_only_decodes_waiting_use_decode_only_rounds():
    table = ConcurrencyTable({Round(0, 1, 0): (0.125, 0.125), Round(0, 2, 0): (0.1875, 0.1875),
                              Round(0, 4, 0): (0.5, 0.5), Round(1, 1, 0): (0.25, 0.125)}, chunks=1, max_batch=1)
    plan = plan_sequence(0, 4, 3, table, 1.0)  # skippable means nothing without UNet tasks
    assert all(r.unet == 0 for r in plan.rounds) and plan.vae == 4
    # [2, 2] costs 2 * 0.1875 + 2 * 0.375 = 1.125, as does [2, 1, 1] (0.375 + 0.3125 + 0.4375):
    # the tie goes to fewer rounds. [1, 2, 1] costs 1.1875, [1, 1, 1, 1] 1.25, [4] 2.0.
    assert plan.rounds == (Round(0, 2, 0), Round(0, 2, 0))
    assert plan.vae_cost == 1.125


def test_no_decodes_takes_the_fastest_plan_skipping_what_is_eligible():
    table = ConcurrencyTable({Round(1, 0, 0): (0.1, 0.0), Round(2, 0, 0): (0.15, 0.0), Round(2, 0, 1): (0.14, 0.0),
                              Round(2, 0, 2): (0.12, 0.0)}, chunks=1, max_batch=2)
    # Every plan costs 0; the tie-break takes the least time: one round, every eligible task skipping.
    assert plan_sequence(2, 0, 2, table, 0.5).rounds == (Round(2, 0, 2),)
    assert plan_sequence(2, 0, 1, table, 0.5).rounds == (Round(2, 0, 1),)
    assert plan_sequence(2, 0, 0, table, 0.0).rounds == (Round(2, 0, 0),)


def test_skippable_beyond_the_unet_tasks_is_clamped():
    table = ConcurrencyTable({Round(1, 1, 1): (0.1, 0.05), Round(1, 1, 0): (0.2, 0.1)}, chunks=1, max_batch=1)
    plan = plan_sequence(1, 1, 5, table, 0.0)
    assert plan.rounds == (Round(1, 1, 1),) and plan.skip == 1


def test_more_unet_tasks_than_the_table_holds():
    table = ConcurrencyTable({Round(1, 0, 0): (0.1, 0.0), Round(2, 0, 0): (0.15, 0.0)}, chunks=1, max_batch=2)
    with pytest.raises(ValueError, match=r"\(m=3, n=0, k=0\)"):
        plan_sequence(3, 0, 0, table, 0.1)


@pytest.mark.parametrize("args", [(-1, 0, 0, 0.1), (1, -1, 0, 0.1), (1, 0, -1, 0.1), (1, 0, 0, -0.1),
                                  (1, 0, 0, float("nan")), (True, 0, 0, 0.1), (1.0, 0, 0, 0.1)])
def test_plan_sequence_rejects_bad_arguments(args):
    table = ConcurrencyTable({Round(1, 0, 0): (0.1, 0.0)}, chunks=1, max_batch=1)
    M, N, K, alpha = args
    with pytest.raises(ValueError):
        plan_sequence(M, N, K, table, alpha)


def test_plan_sequence_rejects_a_non_table():
    with pytest.raises(ValueError, match="ConcurrencyTable"):
        plan_sequence(1, 0, 0, {Round(1, 0, 0): (0.1, 0.0)}, 0.1)


def test_plans_are_deterministic_and_independent_of_row_order():
    rng = random.Random(8)
    for _ in range(30):
        table = random_table(rng, grid=True)
        shuffled_rows = list(table.entries.items())
        rng.shuffle(shuffled_rows)
        shuffled = ConcurrencyTable(dict(shuffled_rows), table.chunks, table.max_batch)
        if not table.has(Round(4, 3, 2)):
            continue
        assert plan_sequence(4, 3, 2, table, 0.3) == plan_sequence(4, 3, 2, shuffled, 0.3)


def test_full_size_problem_is_fast_enough():
    # B_max = 8 and every (m, n <= m, k <= m) row: the largest problem a worker plans.
    rng = random.Random(0)
    rows = {}
    for m in range(1, 9):
        for n in range(m + 1):
            for k in range(m + 1):
                tau = 0.03 + 0.02 * m ** 0.8 + 0.05 * n - 0.004 * k + rng.uniform(0.0, 0.005)
                rows[Round(m, n, k)] = (tau, min(tau, 0.04 * n + rng.uniform(0.0, 0.01)) if n else 0.0)
    table = ConcurrencyTable(rows, chunks=2, max_batch=8)
    plan = plan_sequence(8, 8, 8, table, 0.5)
    assert_feasible(plan, 8, 8, 8, table, 0.5)
    assert plan.vae_cost < 8 * table.delta(Round(8, 8, 8))


# -- assign: the task mapping E ------------------------------------------------------------------


def test_assign_puts_old_decodes_first_and_skippers_where_rounds_skip():
    plan = SequencePlan((Round(1, 1, 0), Round(2, 1, 1), Round(1, 0, 0)), 1.0, 1.0)
    mapping = assign(plan, ["a", "b", "c", "d"], ["c", "d"], ["old", "new"])
    assert mapping == (
        (("a",), (), ("old",)),
        (("b", "c"), ("c",), ("new",)),
        (("d",), (), ()),  # d is eligible but the plan skips CFG for one task only
    )


def test_assign_covers_every_task_once_on_planned_sequences():
    rng = random.Random(3)
    for _ in range(60):
        table = random_table(rng, grid=False)
        M, N, K = rng.randint(1, 4), rng.randint(0, 3), rng.randint(0, 2)
        N = min(N, M)
        if not table.has(Round(M, N, min(K, M))):
            continue
        plan = plan_sequence(M, N, K, table, 0.5)
        unet_ids = [f"u{i}" for i in range(M)]
        skippable = rng.sample(unet_ids, min(K, M))
        vae_ids = [f"v{i}" for i in range(N)]
        mapping = assign(plan, unet_ids, skippable, vae_ids)
        assert len(mapping) == len(plan.rounds)
        for r, (unets, skips, vaes) in zip(plan.rounds, mapping):
            assert (len(unets), len(skips), len(vaes)) == (r.unet, r.skip, r.vae)
            assert set(skips) <= set(unets) and set(skips) <= set(skippable)
        assert sorted(u for unets, _, _ in mapping for u in unets) == sorted(unet_ids)
        assert [v for _, _, vaes in mapping for v in vaes] == vae_ids


@pytest.mark.parametrize("unet_ids, skippable, vae_ids, match", [
    (["a", "b"], [], ["x"], "UNet tasks"),
    (["a", "b", "c", "d"], ["c"], ["x", "y"], "eligible"),
    (["a", "b", "c", "d"], ["z", "c"], ["x", "y"], "not UNet tasks"),
    (["a", "b", "c", "c"], ["c"], ["x", "y"], "repeated"),
    (["a", "b", "c", "d"], ["c", "d"], ["x"], "VAE tasks"),
    (["a", "b", "c", "d"], ["c", "d"], ["x", "a"], "both"),
])
def test_assign_rejects_ids_that_do_not_fit_the_plan(unet_ids, skippable, vae_ids, match):
    plan = SequencePlan((Round(1, 1, 0), Round(2, 1, 1), Round(1, 0, 1)), 1.0, 1.0)
    with pytest.raises(ValueError, match=match):
        assign(plan, unet_ids, skippable, vae_ids)
