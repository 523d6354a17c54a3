"""What ControlNets and LoRAs add to a forward: composed per placement as `addon_costs` documents,
counted from the requests of a batch, fitted from profile rows, and left out (not guessed) where a
profile has none."""

from __future__ import annotations

import pytest

from stepserve.policies.addon_costs import ControlNetPlacement, forward_seconds, ideal_seconds
from stepserve.policies.cost_model import (
    CFG_EXCHANGE,
    CONTROLNET,
    CONTROLNET_TRANSFER,
    DENOISE,
    DENOISE_ENCODER,
    LORA,
    LORA_LOAD,
    BatchShape,
    ProfiledCostModel,
    ProfileRow,
    load_profile,
)
from stepserve.policies.types import ControlNetUse, LoraUse, RequestSpec

INLINE, SERVICE, STALE = ControlNetPlacement


def test_each_placement_composes_as_documented():
    calls = [(4.0, 1.0), (6.0, 0.5)]  # (compute, transfer)
    assert forward_seconds(10.0, 4.0, calls, 0.0, INLINE) == 20.0  # ControlNets, then the UNet
    assert forward_seconds(10.0, 4.0, calls, 0.0, SERVICE) == 6.5 + 6.0  # slowest call beside the encoder half
    assert forward_seconds(10.0, 8.0, calls, 0.0, SERVICE) == 10.0  # hidden behind the encoder half
    assert forward_seconds(10.0, 4.0, calls, 0.0, STALE) == 10.0  # behind the whole forward
    assert forward_seconds(10.0, 4.0, [(12.0, 1.0)], 0.0, STALE) == 13.0
    assert ideal_seconds(10.0, 4.0, calls, 0.0) == 6.0 + 6.0  # free transfers
    # LoRA updates stretch both halves: the encoder half becomes 4 * 12/10.
    assert forward_seconds(10.0, 4.0, [(1.0, 0.0)], 2.0, SERVICE) == pytest.approx(12.0)
    assert forward_seconds(10.0, 4.0, [(6.0, 0.0)], 2.0, SERVICE) == pytest.approx(6.0 + 12.0 - 4.8)
    for placement in ControlNetPlacement:
        assert forward_seconds(10.0, 4.0, [], 2.0, placement) == 12.0


def spec(rid: str, controlnets=(), loras=(), guidance: float = 7.5) -> RequestSpec:
    return RequestSpec(rid, "m", "p", 64, 64, 4, guidance, 0, controlnets=tuple(map(ControlNetUse, controlnets)),
                       loras=tuple(map(LoraUse, loras)))


def test_a_batch_makes_one_controlnet_call_per_controlnet_over_its_users_rows():
    batch = BatchShape.of([spec("a", ["canny"], ["x"]), spec("b", ["canny", "depth"], ["x", "y"]),
                           spec("c", guidance=1.0)])
    assert (batch.rows, batch.controlnet_rows, batch.lora_rows) == (5, (4, 2), 6)
    # The same ControlNet twice (two control images) is still one call over that request's rows.
    assert BatchShape.of([spec("d", ["canny", "canny"])]).controlnet_rows == (2,)
    assert BatchShape.of([spec("e")]) == BatchShape("m", 64, 64, 2)
    with pytest.raises(ValueError, match="controlnet_rows"):
        BatchShape("m", 64, 64, 2, controlnet_rows=(0,))
    with pytest.raises(ValueError, match="lora_rows"):
        BatchShape("m", 64, 64, 2, lora_rows=-1)


def rows(*components: str) -> list[ProfileRow]:
    laws = {DENOISE: 10.0, DENOISE_ENCODER: 4.0, CONTROLNET: 4.5, CONTROLNET_TRANSFER: 0.5, LORA: 1.0}  # ms a row
    return [ProfileRow("m", "dev", c, size, size, n, 1, laws[c] * n * size / 64, 1, "test")
            for c in (DENOISE, *components) for size in (64, 128) for n in (1, 2, 4, 8)]


def test_the_profile_prices_addons_by_placement():
    parts = (CONTROLNET, CONTROLNET_TRANSFER, DENOISE_ENCODER, LORA)
    batch = BatchShape("m", 64, 64, 2, controlnet_rows=(2, 2), lora_rows=2)
    seconds = {p: ProfiledCostModel(rows(*parts), p).denoise_seconds(batch) for p in ControlNetPlacement}
    assert seconds[INLINE] == pytest.approx((20 + 2 + 9 + 9) / 1000)
    assert seconds[SERVICE] == pytest.approx((22 - 8.8 + max(8.8, 10)) / 1000)
    assert seconds[STALE] == pytest.approx(22 / 1000)
    cost = ProfiledCostModel(rows(*parts), SERVICE)
    assert cost.controlnet_seconds(batch) == pytest.approx(18 / 1000)  # the service's devices, both calls
    assert ProfiledCostModel(rows(*parts)).controlnet_seconds(batch) == 0.0  # inline: the denoiser's
    assert cost.step_seconds(batch) > cost.step_seconds(BatchShape("m", 64, 64, 2))
    assert cost.fit_report()["m"]["missing_extras"] == [CFG_EXCHANGE, LORA_LOAD]


def test_a_profile_without_addon_rows_prices_them_at_nothing_and_says_so():
    cost = ProfiledCostModel(rows())
    batch = BatchShape("m", 64, 64, 2, controlnet_rows=(2,), lora_rows=2)
    assert cost.denoise_seconds(batch) == cost.denoise_seconds(BatchShape("m", 64, 64, 2))
    assert cost.fit_report()["m"]["missing_extras"] == [CONTROLNET, CONTROLNET_TRANSFER, DENOISE_ENCODER, LORA,
                                                        CFG_EXCHANGE, LORA_LOAD]
    assert not set(cost.fit_report()["m"]["missing"]) & {CONTROLNET, LORA}  # not a broken profile


@pytest.mark.parametrize("controlnets,paper_ideal", [(1, 1.45), (3, 2.35)])
def test_sdxl_h800_controlnets_beside_the_unet_reach_95_percent_of_the_ideal(controlnets, paper_ideal):
    batch = BatchShape("stable-diffusion-xl-base-1.0", 1024, 1024, 2, controlnet_rows=(2,) * controlnets)
    inline = load_profile("sdxl-h800").denoise_seconds(batch)
    service = load_profile("sdxl-h800", controlnets=SERVICE)
    ideal = inline / ideal_seconds(*service.forward_parts(batch))
    achieved = inline / service.denoise_seconds(batch)
    assert ideal == pytest.approx(paper_ideal, rel=0.05)  # the FLOP split agrees with the paper's Gustafson
    assert 0.95 <= achieved / ideal <= 1.0


def test_the_batching_key_carries_the_lora_set_only_per_adapter():
    a, b = spec("a", loras=["x", "y"]), spec("b", loras=["y", "x"])
    assert a.batch_key(False) == spec("c").batch_key(False) == a.shape_key
    assert a.batch_key(True) == b.batch_key(True) != spec("c").batch_key(True)
    scaled = RequestSpec("d", "m", "p", 64, 64, 4, 7.5, 0, loras=(LoraUse("x", 0.5), LoraUse("y")))
    assert scaled.batch_key(True) != a.batch_key(True)  # another scale is another adapter configuration
