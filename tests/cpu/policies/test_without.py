"""`without`: the snapshot a policy hands the rest of the pool to, equal to one built from scratch
over what is left."""

from __future__ import annotations

from stepserve.policies.base import without
from stepserve.policies.types import ClusterSnapshot

from tests.cpu.policies.snapshots import req, slot, snap


def test_it_equals_the_snapshot_of_what_is_left():
    full = snap({"w0": slot(4, [req("a"), req("b")]), "w1": slot(4, [req("c")]), "w2": slot(4), "w3": slot(2)},
                [req("q0"), req("q1"), req("q2")])
    rest = without(full, ["w1", "w3", "unknown"], ["q1"])
    kept = [w for w in full.workers if w.worker_id in ("w0", "w2")]
    expected = ClusterSnapshot.of(full.now, tuple(v for v in full.queued if v.request_id != "q1"),
                                  tuple(v for v in full.running if v.request_id != "c"), tuple(kept))
    assert rest == expected
    assert rest.index.load_counts == expected.index.load_counts
    assert rest.index.open_ids == ("w0",) and rest.index.open_idle_ids == ("w2",)
    # Join-shortest-queue over what is left: w2's 0 is the least load besides w0.
    assert rest.least_load_with_room(None, excluding="w0") == expected.least_load_with_room(None, excluding="w0") == 0
    assert without(full, ["w2"], []).queued is full.queued  # nothing taken: the same tuple
