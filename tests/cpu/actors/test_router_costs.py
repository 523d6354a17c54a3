"""The router's cost model: the profiles as they are, unless edits reuse cached activations and a
profile measured such forwards (then `mask_aware`, and every other user, sees their cost), or
workers pack resolutions (then a round's plain groups of a packing model are one forward)."""

from __future__ import annotations

import math

import pytest

from stepserve.actors.activation_store import ActivationStoreSpec
from stepserve.actors.worker_options import WorkerPoolSpec
from stepserve.actors.router import RouterSpec, router_costs
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.families import ModelSource, family_class
from stepserve.policies import make_policy
from stepserve.policies.cost_model import (
    DENOISE, BatchShape, ProfiledCostModel, ProfileRow, read_profile, write_profile,
)
from stepserve.policies.instgenie import DiTDims, MaskAwareCosts, forward_flops
from stepserve.policies.patchedserve.mixed_costs import PackedForwardCosts
from stepserve.policies.types import RequestKind, RequestStatus, RequestView, ShapeKey
from stepserve.routing.core import CoreConfig

SD3 = ModelSource("tiny-sd3", "sd3", preset="tiny")
SD15 = ModelSource("tiny-sd", "sd15", preset="tiny")
CACHED = WorkerPoolSpec(edit_cache=ActivationStoreSpec(1 << 30))
PLAIN = WorkerPoolSpec()
PACKING = WorkerPoolSpec(pack_resolutions=True)


def profile(path, masked: bool):
    """Full forwards of both models; with `masked`, tiny-sd3's masked forwards at a third of the
    full forward's seconds per FLOP (and tiny-sd's, which has no cached edits)."""
    dims = family_class("sd3").dit_dims(SD3, CacheKind.KEYS_VALUES)
    rows = []
    for model in ("tiny-sd3", "tiny-sd"):
        for size in (64, 128):
            for n in (1, 2, 4, 8):
                full_ms = 1.0 + 2e-6 * forward_flops(dims, size, size, n)
                rows.append(ProfileRow(model, "cpu", DENOISE, size, size, n, 1, full_ms, 3, "test"))
                for ratio in (0.25, 0.5) if masked and n % 2 == 0 else ():
                    ms = 0.5 + 2e-6 / 3 * forward_flops(dims, size, size, n, ratio)
                    rows.append(ProfileRow(model, "cpu", DENOISE, size, size, n, 1, ms, 3, "test", 1, ratio))
    write_profile(path, rows)
    return str(path)


def spec(*profiles):
    return RouterSpec("mask_aware", {}, profiles, CoreConfig(cached_edits=True))


def test_costs_are_wrapped_only_where_edits_use_the_cache_and_the_profile_measured_them(tmp_path):
    full, masked = profile(tmp_path / "full.csv", False), profile(tmp_path / "masked.csv", True)
    assert router_costs(spec(), [SD3], CACHED) is None  # no profile: policies learn
    assert type(router_costs(spec(full), [SD3, SD15], CACHED)) is ProfiledCostModel  # nothing masked measured
    assert type(router_costs(spec(masked), [SD3, SD15], PLAIN)) is ProfiledCostModel  # edit cache off
    costs = router_costs(spec(masked), [SD3, SD15], CACHED)
    assert isinstance(costs, MaskAwareCosts) and set(costs.edits) == {"tiny-sd3"}  # tiny-sd has no cached edits
    dims = costs.edits["tiny-sd3"].dims
    assert dims == (DiTDims(2, 32, patch=2, text_tokens=333, latent_factor=8, bytes_per_value=4, keys_values=True),)
    outputs = router_costs(spec(masked), [SD3], WorkerPoolSpec(edit_cache=CACHED.edit_cache,
                                                               edit_cache_kind=CacheKind.OUTPUTS))
    assert not outputs.edits["tiny-sd3"].dims[0].keys_values  # the FLOPs of the configured cache kind
    for model, size, rows in (("tiny-sd3", 64, 2), ("tiny-sd3", 128, 8), ("tiny-sd", 128, 8)):
        full_s = costs.denoise_seconds(BatchShape(model, size, size, rows))
        masked_s = costs.denoise_seconds(BatchShape(model, size, size, rows, mask_ratio=0.25))
        assert masked_s < full_s / 2 if model == "tiny-sd3" else masked_s == full_s


def edit(rid, template, cache_on=True):
    """A CFG edit at mask 0.25, batched apart from other edits where the cache is on (`batch_key`)."""
    key = ShapeKey("tiny-sd3", 128, 128, cached_edit=cache_on and template is not None)
    return RequestView(rid, RequestKind.EDIT, key, 2, 0, 10, 0.0, math.inf, True, RequestStatus.QUEUED,
                       mask_ratio=0.25, template_id=template)


def test_mask_aware_placement_sees_the_masked_cost(tmp_path):
    masked = profile(tmp_path / "masked.csv", True)
    cached = make_policy("mask_aware", {}, router_costs(spec(masked), [SD3], CACHED))
    # A worker busy with a masked edit finishes a new one sooner than one busy with a full edit.
    assert cached.cost([edit("a", "t")], edit("new", "t")) < cached.cost([edit("a", None)], edit("new", "t"))
    # Cache off: an edit naming a template computes in full, and is priced so.
    plain = make_policy("mask_aware", {}, router_costs(spec(masked), [SD3], PLAIN))
    assert (plain.cost([edit("a", "t", False)], edit("new", "t", False))
            == plain.cost([edit("a", None, False)], edit("new", None, False)))


def test_packing_workers_price_a_rounds_plain_groups_of_a_packing_model_as_one_forward(tmp_path):
    wan = ModelSource("tiny-wan", "wan", preset="tiny")  # a video model cannot pack: its groups stay apart
    full = profile(tmp_path / "full.csv", False)
    costs = router_costs(spec(full), [SD3, SD15, wan], PACKING)
    assert isinstance(costs, PackedForwardCosts) and costs.packing == {"tiny-sd3", "tiny-sd"}
    assert costs.fits == {}  # the profile measured no packed forward: the roofline estimate prices them
    assert type(router_costs(spec(full), [SD3], PLAIN)) is ProfiledCostModel
    assert type(router_costs(spec(full), [wan], PACKING)) is ProfiledCostModel  # nothing packs
    sizes = [BatchShape("tiny-sd3", 64, 64, 2), BatchShape("tiny-sd3", 128, 128, 2)]
    assert costs.round_seconds(sizes) < costs.base.round_seconds(sizes)
    masked_cost = router_costs(spec(profile(tmp_path / "masked.csv", True)), [SD3],
                               WorkerPoolSpec(edit_cache=CACHED.edit_cache, pack_resolutions=True))
    assert isinstance(masked_cost, PackedForwardCosts) and isinstance(masked_cost.base, MaskAwareCosts)


def test_packed_forwards_a_profile_measured_are_priced_as_measured(tmp_path):
    """tiny-sd's patched forwards measured 1.3x the groups in turn (a CPU): the router prices them
    so, not by the roofline estimate's promise."""
    base = ProfiledCostModel.from_csv(profile(tmp_path / "full.csv", False))
    rows = list(read_profile(tmp_path / "full.csv"))
    for n in (1, 2, 4):
        mix = [BatchShape("tiny-sd", 64, 64, n), BatchShape("tiny-sd", 128, 128, n)]
        ms = 1.3e3 * sum(base.denoise_seconds(b) for b in mix)
        rows.append(ProfileRow("tiny-sd", "cpu", DENOISE, 128, 128, 2 * n, 1, ms, 3, "test",
                               groups=((64, 64, n), (128, 128, n))))
    write_profile(tmp_path / "packed.csv", rows)
    costs = router_costs(spec(str(tmp_path / "packed.csv")), [SD3, SD15], PACKING)
    assert set(costs.fits) == {"tiny-sd"}
    assert costs.fits["tiny-sd"].roofline == 0 and costs.fits["tiny-sd"].sequential == pytest.approx(1.3)
    mix = [BatchShape("tiny-sd", 64, 64, 2), BatchShape("tiny-sd", 128, 128, 8)]
    assert costs.packed_forward_seconds(mix) == pytest.approx(1.3 * sum(base.denoise_seconds(b) for b in mix))
    sd3 = [BatchShape("tiny-sd3", 64, 64, 2), BatchShape("tiny-sd3", 128, 128, 8)]
    assert costs.packed_forward_seconds(sd3) == costs.estimate_seconds(sd3)  # unmeasured: the estimate
