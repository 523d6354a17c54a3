"""The policy by name: registry lookup, its config, and the analyzers it trains when built."""

from __future__ import annotations

import math

import pytest

from stepserve.policies import Scheduler, make_policy, needs_costs, policy_names
from stepserve.policies.cost_model import load_profile
from stepserve.policies.patchedserve import PackedForwardCosts, PatchedServeConfig, PatchedServePolicy, Predictor
from stepserve.policies.registry import validate_policy

from tests.cpu.policies.patchedserve.fakes import LinearCosts


def test_registered_as_a_whole_pool_scheduler_that_needs_costs():
    assert "patchedserve" in policy_names()
    assert needs_costs("patchedserve")
    costs = LinearCosts()
    policy = make_policy("patchedserve", {"throughput_slack": 1.5, "predictor": "cost_model"}, costs)
    assert isinstance(policy, PatchedServePolicy) and isinstance(policy, Scheduler)
    assert policy.name == "patchedserve" and policy.steady and policy.joins_running and not policy.splits_cfg
    assert policy.config == PatchedServeConfig(throughput_slack=1.5, predictor=Predictor.COST_MODEL)
    assert policy.pricing is costs
    with pytest.raises(ValueError, match="router.profiles"):
        make_policy("patchedserve")


def test_it_prices_packed_forwards_where_it_is_given_packed_costs():
    packed = PackedForwardCosts(LinearCosts())
    assert make_policy("patchedserve", {"predictor": "cost_model"}, packed).pricing is packed


def test_yaml_lists_become_tuples_and_bad_options_say_what_to_fix():
    config = validate_policy("patchedserve", {"sizes": [[512, 512], [1024, 768]], "throughput_slack": math.inf})
    assert config.sizes == ((512, 512), (1024, 768))
    for options, words in [({"sizes": []}, "sizes"), ({"sizes": [[512, 512], [512, 512]]}, "sizes"),
                           ({"sizes": [[512]]}, "sizes"), ({"throughput_slack": math.nan}, "throughput_slack"),
                           ({"throughput_slack": True}, "throughput_slack"), ({"predictor": "oracle"}, "oracle"),
                           ({"max_batch_size": 0}, "max_batch_size"), ({"training_samples": 5}, "training_samples"),
                           ({"mix_resolutions": True}, "unknown option"), ({"seed": 1.5}, "seed"),
                           ({"window_s": 1}, "unknown option")]:
        with pytest.raises(ValueError, match=words):
            validate_policy("patchedserve", options)
    assert PatchedServeConfig().training_batch == 12 and PatchedServeConfig(max_batch_size=8).training_batch == 8


def test_built_on_a_profile_it_trains_an_analyzer_per_model_and_keeps_its_held_out_error():
    """tiny-sd3-cpu measured 48 batches at these sizes (test_measured_analyzer.py says more)."""
    options = {"sizes": [[64, 64], [128, 128], [256, 256]]}
    policy = make_policy("patchedserve", options, PackedForwardCosts(load_profile("tiny-sd3-cpu")))
    report = policy.holdout["tiny-sd3"]
    assert report.measured == 38 and report.test == 10 and report.mean_rel_err < 0.12
    assert set(policy.latency.analyzers) == {"tiny-sd3"}
    assert make_policy("patchedserve", {"predictor": "cost_model"}, load_profile("sdxl-h800")).holdout == {}
