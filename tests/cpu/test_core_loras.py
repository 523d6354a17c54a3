"""LoRAs in the router core. `CoreConfig.lora_batches`: with mixed batches (the default) requests
with different LoRAs share a forward; per adapter, each forward holds one LoRA set, and a policy
that tries otherwise is refused before anything changes. The core mirrors which LoRAs each worker
holds (as its `StoreLoras` keeps them) and shows it to policies; the simulator's worker keeps the
same and pays for what it brings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve.load_tests.sim.worker import SimAdmission, SimWorker
from stepserve.policies.base import PolicyError
from stepserve.policies.types import Decision, LoraBatching, LoraUse, StepGroup, WorkerPlan
from stepserve.routing.lora_residency import LoraResidency
from tests.cpu.core_harness import Harness, spec


def styled(rid: str, *loras: str):
    return replace(spec(rid), loras=tuple(LoraUse(name) for name in loras))


def groups_of_first_plan(lora_batches: LoraBatching) -> list[tuple[str, ...]]:
    harness = Harness(workers=1, batch=8, lora_batches=lora_batches)
    harness.submit(styled("a", "x"), styled("b", "y"), styled("c", "x"), styled("d"), styled("e", "x", "y"),
                   styled("f", "y", "x"))
    harness.schedule()
    plan = harness.sent[0]
    assert harness.run() >= 0 and all(harness.status(r).value == "finished" for r in "abcdef")
    return [group.request_ids for group in plan.groups]


def test_mixed_batches_put_every_lora_in_one_forward():
    assert groups_of_first_plan(LoraBatching.MIXED) == [("a", "b", "c", "d", "e", "f")]


def test_per_adapter_gives_each_lora_set_its_own_forward():
    assert sorted(groups_of_first_plan(LoraBatching.PER_ADAPTER)) == [("a", "c"), ("b",), ("d",), ("e", "f")]


class MixesAdapters:
    """A policy that puts two LoRA sets in one group."""

    def schedule(self, snapshot):
        ids = tuple(v.request_id for v in snapshot.queued)
        return Decision((WorkerPlan("w0", admit=ids, groups=(StepGroup(ids),)),))


def test_a_plan_that_mixes_adapters_is_refused_per_adapter():
    harness = Harness(policy=MixesAdapters(), workers=1, batch=8, lora_batches=LoraBatching.PER_ADAPTER)
    harness.submit(styled("a", "x"), styled("b", "y"))
    with pytest.raises(PolicyError, match="mixes shapes"):
        harness.schedule()


def test_a_residency_drops_the_least_recently_used_not_in_use():
    held = LoraResidency(2)
    assert held.bring([("m", "a"), ("m", "b")], []) == 2
    assert held.bring([("m", "a")], []) == 0  # "a" is now the most recent
    assert held.bring([("m", "c")], []) == 1 and held.held() == {("m", "a"), ("m", "c")}
    in_use = [("m", "a"), ("m", "c"), ("m", "d")]
    assert held.bring([("m", "d")], in_use) == 1  # all in use: over capacity for now
    assert held.held() == {("m", "a"), ("m", "c"), ("m", "d")}
    assert held.use(("m", "a")) and held.trim([]) == [("m", "c")]  # what the worker's StoreLoras removes
    assert held.held() == {("m", "d"), ("m", "a")} and ("m", "c") not in held
    with pytest.raises(ValueError):
        LoraResidency(0)


def test_the_core_shows_policies_what_each_worker_holds():
    harness = Harness(workers=2, batch=4)
    harness.submit(styled("a", "x", "y"))
    harness.schedule()
    holder = harness.sent[0].worker_id
    views = {w.worker_id: w for w in harness.core.snapshot(harness.now).workers}
    assert views[holder].loras == {("m", "x"), ("m", "y")}
    assert all(not w.loras for wid, w in views.items() if wid != holder)
    harness.run()
    assert harness.core.snapshot(harness.now).worker(holder).loras == {("m", "x"), ("m", "y")}  # kept after
    harness.core.worker_lost(holder, harness.now)
    harness.core.worker_back(holder, "again")
    assert not harness.core.snapshot(harness.now).worker(holder).loras  # a restart holds nothing


def test_the_simulated_worker_pays_for_the_loras_it_brings():
    worker = SimWorker("w0", lambda shapes: 0.1, lambda spec: 0.0, lora_load_cost=lambda model: 0.5,
                       lora_resident=2)
    first = worker.start(WorkerPlan("w0", admit=("a",), groups=(StepGroup(("a",)),)),
                         {"a": SimAdmission(styled("a", "x", "y"), None)})
    assert first.head_s == 1.0 and worker.lora_loads == 2
    again = worker.start(WorkerPlan("w0", admit=("b",), groups=(StepGroup(("a", "b")),)),
                         {"b": SimAdmission(styled("b", "x"), None)})
    assert again.head_s == 0.0 and worker.lora_loads == 2  # held already
