"""The pool grows and shrinks under the core: a worker joins (`add_worker`), drains at a step
boundary handing what it holds back to the queue (`drain`), and leaves (`remove_worker`); every
request still ends with all of its steps, and the load signal (`pool_load`) counts what waits."""

from collections import deque

import pytest

from stepserve.load_tests.sim.worker import SimWorker
from stepserve.policies.types import RequestStatus as S
from stepserve.routing.core import WorkerSlot

from tests.cpu.core_harness import TICK, Harness, spec


def join(h: Harness, wid: str, rank: int, batch: int = 4) -> None:
    h.core.add_worker(WorkerSlot(wid, batch, rank), incarnation=f"{wid}-1")
    h.workers[wid] = SimWorker(wid, lambda shapes: TICK, lambda s: 0.0, incarnation=f"{wid}-1")
    h.queues[wid] = deque()


def test_a_worker_that_joins_takes_work_from_the_next_round():
    h = Harness(workers=1, batch=2)
    h.submit(*(spec(f"r{i}", steps=4) for i in range(4)))
    h.round()
    join(h, "w9", rank=9, batch=2)
    h.run()
    assert all(h.status(f"r{i}") is S.FINISHED for i in range(4))
    assert any(p.worker_id == "w9" and p.admit for p in h.sent)


def test_a_draining_worker_exports_what_it_holds_and_the_rest_of_the_pool_finishes_it():
    h = Harness(workers=2, batch=4)
    h.submit(*(spec(f"r{i}", steps=6) for i in range(4)))
    h.round()
    h.round()
    held = set(h.core.worker_record("w1").residents)
    assert held
    assert h.core.drain("w1")
    h.run()
    exports = [p for p in h.sent if p.worker_id == "w1" and p.export]
    assert len(exports) == 1 and set(exports[0].export) == held
    # Nothing was planned on w1 after its export, and it left nothing behind.
    assert max(p.plan_id for p in h.sent if p.worker_id == "w1") == exports[0].plan_id
    assert h.core.drained("w1")
    for i in range(4):
        state = h.core.state(f"r{i}")
        assert state.status is S.FINISHED and state.steps_done == 6
    assert all(h.core.state(rid).pauses == 1 for rid in held)
    h.core.remove_worker("w1")
    assert h.core.worker_ids == ("w0",)
    h.submit(spec("after", steps=2))
    h.run()
    assert h.status("after") is S.FINISHED


def test_a_long_plan_on_a_draining_worker_is_cut_at_its_next_step():
    h = Harness(workers=2, batch=4, depth=1, max_plan_s=0.05)
    h.submit(spec("long", steps=20))
    h.schedule()
    (wid,) = [w for w, q in h.queues.items() if q]
    while h.queues[wid][0][0].steps == 1:  # the worker's step time is known after its first report
        h.now += TICK
        h.execute(wid)
        h.schedule()
    plan = h.queues[wid][0][0]
    h.now += TICK  # a step into it
    assert h.core.drain(wid)
    h.schedule()
    assert h.interrupts == [(wid, plan.plan_id)]
    h.execute(wid, steps_run=1)
    h.run()
    assert h.status("long") is S.FINISHED and h.core.state("long").steps_done == 20
    assert h.core.drained(wid) and h.core.state("long").pauses == 1


def test_drain_refuses_the_last_live_worker_and_remove_refuses_a_busy_one():
    h = Harness(workers=2, batch=4)
    assert h.core.drain("w0")
    assert not h.core.drain("w1")  # the last one that takes plans
    assert not h.core.drain("w0")  # already draining
    h.submit(spec("a", steps=3))
    h.round()
    with pytest.raises(ValueError, match="still holds work or was not drained"):
        h.core.remove_worker("w1")
    with pytest.raises(ValueError, match="duplicate worker id"):
        h.core.add_worker(WorkerSlot("w0", 4, 7))
    with pytest.raises(ValueError, match="rank 1 is taken"):
        h.core.add_worker(WorkerSlot("w5", 4, 1))


def test_a_drained_worker_that_dies_is_removed_and_nothing_is_lost():
    h = Harness(workers=2, batch=4)
    h.submit(*(spec(f"r{i}", steps=5) for i in range(3)))
    h.round()
    assert h.core.drain("w0")
    h.core.worker_lost("w0", h.now)  # dies while draining: what it held resumes elsewhere
    h.queues["w0"].clear()
    h.run()
    assert all(h.status(f"r{i}") is S.FINISHED for i in range(3))
    h.core.remove_worker("w0")
    assert h.core.worker_ids == ("w1",)


def test_the_load_signal_counts_demand_and_the_waiting_requests_already_late():
    h = Harness(workers=1, batch=2)
    h.submit(*(spec(f"r{i}", steps=4, slo_s=100.0) for i in range(3)))
    h.submit(spec("tight", steps=4, slo_s=0.001))
    load = h.core.pool_load(h.now + 0.01)
    assert (load.demand, load.waiting) == (4, 4)
    assert load.late == 1  # only the tight one is past its deadline: no step time is measured yet
    h.round()
    h.round()
    load = h.core.pool_load(h.now + 200.0)
    assert (load.demand, load.waiting, load.late) == (4, 2, 2)  # the two still waiting are past their deadlines


def test_rerank_gives_the_rebuilt_world_s_ranks_and_the_snapshot_follows_them():
    h = Harness(workers=3, batch=4)
    h.core.rerank(["w2", "w0", "w1"])
    assert [h.core.rank(w) for w in ("w2", "w0", "w1")] == [0, 1, 2]
    assert list(h.core.snapshot(h.now).index.workers_by_id) == ["w2", "w0", "w1"]
    with pytest.raises(ValueError, match="every worker once"):
        h.core.rerank(["w0", "w1"])
    h.submit(spec("a", steps=3))
    h.run()
    assert h.status("a") is S.FINISHED


def test_a_new_router_resumes_a_request_from_a_checkpoint_an_older_one_adopted():
    from stepserve.routing.core import Resume

    old = Harness(workers=1, batch=2, checkpoint_interval_s=0.0)
    old.submit(spec("v", steps=8, frames=5))
    for _ in range(4):
        old.round()
    (rid, checkpoint), *_ = [pair for o in old.outcomes for pair in o.checkpointed][-1:]
    assert rid == "v" and 0 < checkpoint.steps < 8 and len(checkpoint.degrees) == checkpoint.steps
    new = Harness(workers=1, batch=2)  # the old one's workers are gone; the state is not
    new.core.submit(spec("v", steps=8, frames=5), new.now, resume=checkpoint)
    assert new.status("v") is S.PAUSED and new.core.state("v").steps_done == checkpoint.steps
    new.run()
    state = new.core.state("v")
    assert state.status is S.FINISHED and state.steps_done == 8 and len(state.degrees) == 8
    assert sum(len(p.stepping) for p in new.sent) == 8 - checkpoint.steps  # only the steps left
