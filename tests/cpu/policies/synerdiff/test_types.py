"""Validation and lookups of the SynerDiff values."""

from __future__ import annotations

import pickle

import pytest

from stepserve.policies.synerdiff import ConcurrencyTable, Round, SequencePlan

ROWS = [(1, 0, 0, 0.10, 0.0), (1, 1, 0, 0.14, 0.09), (2, 1, 1, 0.16, 0.12), (0, 2, 0, 0.2, 0.2)]


@pytest.mark.parametrize("args", [(-1, 0, 0), (1, -1, 0), (1, 0, -1), (1, 0, 2), (0, 0, 0), (True, 0, 0),
                                  (1.0, 0, 0), (0, 1, 1)])
def test_round_rejects_impossible_counts(args):
    with pytest.raises(ValueError, match="Round"):
        Round(*args)


def test_round_orders_as_its_counts_and_allows_decode_only_rounds():
    assert sorted([Round(2, 0, 0), Round(1, 1, 1), Round(1, 1, 0), Round(0, 3, 0)]) == [
        Round(0, 3, 0), Round(1, 1, 0), Round(1, 1, 1), Round(2, 0, 0)]
    assert str(Round(2, 1, 1)) == "(m=2, n=1, k=1)"


def test_table_from_rows_looks_up_tau_and_delta():
    table = ConcurrencyTable.from_rows(ROWS, chunks=2, max_batch=2)
    assert table.tau(Round(1, 1, 0)) == 0.14 and table.delta(Round(1, 1, 0)) == 0.09
    assert table.has(Round(0, 2, 0)) and not table.has(Round(2, 0, 0))
    assert table.rounds() == (Round(0, 2, 0), Round(1, 0, 0), Round(1, 1, 0), Round(2, 1, 1))
    assert (table.chunks, table.max_batch) == (2, 2)
    assert table == ConcurrencyTable({Round(*r[:3]): r[3:] for r in ROWS}, chunks=2, max_batch=2)
    assert hash(table) == hash(ConcurrencyTable.from_rows(ROWS, chunks=2, max_batch=2))


def test_table_names_a_missing_round():
    table = ConcurrencyTable.from_rows(ROWS, chunks=2, max_batch=2)
    with pytest.raises(KeyError, match=r"\(m=2, n=0, k=0\).*c=2"):
        table.tau(Round(2, 0, 0))
    with pytest.raises(KeyError, match=r"\(m=2, n=2, k=0\)"):
        table.delta(Round(2, 2, 0))


def test_table_is_a_copy_that_cannot_change():
    entries = {Round(1, 0, 0): (0.1, 0.0)}
    table = ConcurrencyTable(entries, chunks=1, max_batch=1)
    entries[Round(1, 0, 0)] = (9.0, 0.0)
    assert table.tau(Round(1, 0, 0)) == 0.1
    with pytest.raises(TypeError):
        table.entries[Round(1, 0, 0)] = (9.0, 0.0)


def test_table_pickles():
    table = ConcurrencyTable.from_rows(ROWS, chunks=2, max_batch=2)
    copy = pickle.loads(pickle.dumps(table))
    assert copy == table and copy.tau(Round(2, 1, 1)) == 0.16


@pytest.mark.parametrize("rows, match", [
    ([(1, 0, 0, 0.0, 0.0)], "tau"),
    ([(1, 0, 0, -0.1, 0.0)], "tau"),
    ([(1, 0, 0, float("inf"), 0.0)], "tau"),
    ([(1, 1, 0, 0.1, 0.2)], "delta"),
    ([(1, 1, 0, 0.1, -0.01)], "delta"),
    ([(1, 0, 0, 0.1, 0.05)], "decodes nothing"),
    ([(3, 0, 0, 0.1, 0.0)], "max_batch"),
    ([(1, 0, 0, 0.1, 0.0), (1, 0, 0, 0.2, 0.0)], "twice"),
    ([(1, 0, 0, 0.1)], "a row is"),
    ([(1, 2, 3, 0.1, 0.0)], "skip"),
    ([], "no rows"),
])
def test_table_rejects_bad_rows(rows, match):
    with pytest.raises(ValueError, match=match):
        ConcurrencyTable.from_rows(rows, chunks=1, max_batch=2)


def test_table_rejects_bad_keys_values_and_bounds():
    with pytest.raises(ValueError, match="keys must be Round"):
        ConcurrencyTable({(1, 0, 0): (0.1, 0.0)}, chunks=1, max_batch=1)
    with pytest.raises(ValueError, match=r"\(tau, delta\)"):
        ConcurrencyTable({Round(1, 0, 0): 0.1}, chunks=1, max_batch=1)
    with pytest.raises(ValueError, match="chunks"):
        ConcurrencyTable({Round(1, 0, 0): (0.1, 0.0)}, chunks=0, max_batch=1)
    with pytest.raises(ValueError, match="max_batch"):
        ConcurrencyTable({Round(1, 0, 0): (0.1, 0.0)}, chunks=1, max_batch=0)
    with pytest.raises(ValueError, match="mapping"):
        ConcurrencyTable([(Round(1, 0, 0), (0.1, 0.0))], chunks=1, max_batch=1)


def test_sequence_plan_totals_and_validation():
    plan = SequencePlan((Round(2, 1, 1), Round(1, 1, 0), Round(1, 0, 1)), 0.5, 0.4)
    assert (plan.unet, plan.vae, plan.skip) == (4, 2, 2)
    empty = SequencePlan((), 0.0, 0.0)
    assert (empty.unet, empty.vae, empty.skip) == (0, 0, 0)
    with pytest.raises(ValueError, match="tuple of Round"):
        SequencePlan([Round(1, 0, 0)], 0.0, 0.1)
    with pytest.raises(ValueError, match="vae_cost"):
        SequencePlan((Round(1, 0, 0),), -1.0, 0.1)
    with pytest.raises(ValueError, match="seconds"):
        SequencePlan((Round(1, 0, 0),), 0.0, float("nan"))
