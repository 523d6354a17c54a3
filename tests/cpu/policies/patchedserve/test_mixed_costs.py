"""The mixed-resolution pricing: one forward of several resolutions from one-resolution rows."""

from __future__ import annotations

import itertools

import pytest

from stepserve.policies.cost_model import BatchShape, load_profile
from stepserve.policies.patchedserve import PackedForwardCosts, packed

from tests.cpu.policies.patchedserve.fakes import LinearCosts

SDXL = "stable-diffusion-xl-base-1.0"


@pytest.fixture(scope="module")
def sdxl():
    return load_profile("sdxl-h800")


def test_a_profile_linear_in_rows_packs_to_one_fixed_part_plus_each_groups_variable_part():
    base = LinearCosts(fixed=0.01, round_s=0.003)
    costs = PackedForwardCosts(base)
    shapes = [BatchShape("sd", 64, 64, 4), BatchShape("sd", 128, 128, 6)]
    variable = 0.005 * 4 + 0.02 * 6
    assert costs.round_seconds(shapes) == pytest.approx(0.01 + variable + 0.003)
    assert base.round_seconds(shapes) == pytest.approx(2 * 0.01 + variable + 0.003)  # today: one forward each


def test_one_resolution_costs_what_the_profile_says(sdxl):
    costs = PackedForwardCosts(sdxl)
    for size, rows in itertools.product((512, 768, 1024), (1, 2, 7, 16)):
        shape = BatchShape(SDXL, size, size, rows)
        assert costs.round_seconds([shape]) == sdxl.round_seconds([shape])
        assert costs.step_seconds(shape) == sdxl.step_seconds(shape)
    assert costs.solo_seconds(SDXL, 768, 768, 50, True) == sdxl.solo_seconds(SDXL, 768, 768, 50, True)


def test_a_packed_forward_lies_between_its_dearest_group_and_all_groups_in_turn(sdxl):
    costs = PackedForwardCosts(sdxl)
    for rows in itertools.product((0, 1, 2, 6, 12), repeat=3):
        shapes = [BatchShape(SDXL, s, s, r) for s, r in zip((512, 768, 1024), rows) if r]
        if len(shapes) < 2:
            continue
        alone = [sdxl.denoise_seconds(b) for b in shapes]
        forward = costs.packed_forward_seconds(shapes)
        assert max(alone) - 1e-12 <= forward <= sum(alone) + 1e-12, rows


def test_packing_small_groups_on_a_device_with_a_floor_saves_most_of_a_forward(sdxl):
    # SDXL on the H800 costs about 35 ms a forward however small: one CFG request at each of
    # 512, 768 and 1024 px fills the device far less than three forwards do.
    shapes = [BatchShape(SDXL, s, s, 2) for s in (512, 768, 1024)]
    separate, together = sdxl.round_seconds(shapes), PackedForwardCosts(sdxl).round_seconds(shapes)
    assert together < 0.75 * separate
    assert together > sdxl.round_seconds([shapes[-1]])  # but more than the 1024 px one alone


def test_more_work_never_costs_less(sdxl):
    costs = PackedForwardCosts(sdxl)
    for rows in itertools.product((1, 2, 4), repeat=3):
        shapes = [BatchShape(SDXL, s, s, r) for s, r in zip((512, 768, 1024), rows)]
        for i in range(3):
            more = list(shapes)
            more[i] = BatchShape(SDXL, more[i].height, more[i].width, more[i].rows + 2)
            assert costs.round_seconds(more) >= costs.round_seconds(shapes) - 1e-12


def test_only_plain_image_forwards_of_one_model_pack():
    base = LinearCosts()
    costs = PackedForwardCosts(base)
    plain = BatchShape("sd", 64, 64, 2)
    lora = BatchShape("sd", 128, 128, 2, lora_rows=2)
    # The LoRA batch runs as its own forward, as the base prices it.
    assert costs.round_seconds([plain, lora]) == pytest.approx(base.round_seconds([plain, lora]))
    other = BatchShape("other", 128, 128, 2)
    # Two models: one forward each, so no fixed part is saved.
    assert costs.round_seconds([plain, other]) == pytest.approx(base.round_seconds([plain, other]))
    with pytest.raises(ValueError, match="one model"):
        costs.packed_forward_seconds([plain, other])
    with pytest.raises(ValueError, match="plain image"):
        costs.packed_forward_seconds([plain, lora])


def test_packing_is_not_applied_twice():
    costs = PackedForwardCosts(LinearCosts())
    assert packed(costs) is costs
    assert isinstance(packed(LinearCosts()), PackedForwardCosts)
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match="probe_rows"):
            PackedForwardCosts(LinearCosts(), probe_rows=bad)
