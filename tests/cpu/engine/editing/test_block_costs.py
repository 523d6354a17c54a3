"""Per-slot costs of a masked forward on the tiny SD3 transformer, for both cache kinds: one entry
per cache slot (a keys-values record's last slot is the output layer), every cost measured, no
load on CPU (nothing is copied) unless a load is given (timed per slot); a record of the other
kind's length is refused."""

import time

import pytest
import torch

from stepserve.engine.editing.block_costs import measure_block_costs
from stepserve.engine.editing.masked_sd3 import CacheKind, SD3Inputs, cache_slots, recording_forward, token_index
from stepserve.engine.families import DENOISER, load_family

from tests.tiny import TINY_SD3


@pytest.fixture(scope="module")
def preset():
    return load_family(TINY_SD3, {DENOISER}, "cpu").denoiser


def _inputs(transformer) -> SD3Inputs:
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return SD3Inputs(torch.randn(2, cfg.in_channels, 16, 16, generator=g),
                     torch.randn(2, 5, cfg.joint_attention_dim, generator=g),
                     torch.randn(2, cfg.pooled_projection_dim, generator=g), torch.tensor([700.0, 700.0]))


@pytest.mark.parametrize("kind", list(CacheKind))
def test_one_cost_per_slot(preset, kind):
    inputs = _inputs(preset)
    _, record = recording_forward(preset, inputs, kind)
    mask = torch.zeros(2, 1, 16, 16)
    mask[:, :, 2:6, 4:10] = 1
    costs = measure_block_costs(preset, inputs, token_index(mask, 2), record, "cpu", warmup=0, repeats=1, kind=kind)
    slots = cache_slots(preset, kind)
    assert len(costs.c_with) == len(costs.c_without) == slots
    assert all(c > 0 for c in costs.c_with + costs.c_without)
    assert costs.load == (0.0,) * slots


def test_a_record_of_the_other_kind_is_refused(preset):
    inputs = _inputs(preset)
    _, outputs = recording_forward(preset, inputs)
    index = token_index(torch.ones(2, 1, 16, 16), 2)
    with pytest.raises(ValueError, match="3"):
        measure_block_costs(preset, inputs, index, outputs, "cpu", kind=CacheKind.KEYS_VALUES)


def test_a_given_load_is_timed_per_slot(preset):
    """On a CPU node the slow tier is the disk: `load_slot` is what L times, once per sample."""
    inputs = _inputs(preset)
    _, record = recording_forward(preset, inputs)
    mask = torch.zeros(2, 1, 16, 16)
    mask[:, :, 2:6, 4:10] = 1
    loaded = []

    def load_slot(slot):
        loaded.append(slot)
        time.sleep(0.002 * (slot + 1))

    costs = measure_block_costs(preset, inputs, token_index(mask, 2), record, "cpu", warmup=1, repeats=2,
                                load_slot=load_slot)
    slots = cache_slots(preset, CacheKind.OUTPUTS)
    assert loaded == [s for s in range(slots) for _ in range(3)]
    assert all(0.002 * (s + 1) <= costs.load[s] < 0.002 * (s + 1) + 0.05 for s in range(slots))
