"""`CoreConfig.lora_batches`: with mixed batches (the default) requests with different LoRAs share a
forward; per adapter, each forward holds one LoRA set, and a policy that tries otherwise is refused
before anything changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve.policies.base import PolicyError
from stepserve.policies.types import Decision, LoraBatching, LoraUse, StepGroup, WorkerPlan
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
