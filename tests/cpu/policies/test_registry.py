"""Policy lookup by name: what configs and the simulator rely on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import stepserve.policies as policies
from stepserve.policies import SchedulingPolicy, make_policy, policy_names
from stepserve.policies.registry import register_policy


def test_builtin_policies_are_registered():
    names = policy_names()
    assert "continuous" in names and "static_fcfs" in names
    assert names == sorted(names)


@pytest.mark.parametrize("name", ["continuous", "static_fcfs"])
def test_make_policy_builds_a_scheduling_policy(name):
    policy = make_policy(name)
    assert isinstance(policy, SchedulingPolicy)
    assert policy.name == name
    assert make_policy(name, {"max_batch_size": 3}).config.max_batch_size == 3
    assert make_policy(name, None).config.max_batch_size is None


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        make_policy("round_robin")
    message = str(info.value)
    assert "round_robin" in message
    assert "continuous" in message and "static_fcfs" in message


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="max_batch") as info:
        make_policy("continuous", {"max_batch": 4})
    assert "max_batch_size" in str(info.value)  # the valid spelling is suggested


def test_invalid_option_value_is_named():
    with pytest.raises(ValueError, match="max_batch_size"):
        make_policy("static_fcfs", {"max_batch_size": 0})


def test_option_dict_is_not_mutated():
    options = {"max_batch_size": 2}
    make_policy("continuous", options)
    assert options == {"max_batch_size": 2}


def test_duplicate_name_with_another_class_is_rejected():
    @dataclass(frozen=True)
    class NoConfig:
        pass

    with pytest.raises(ValueError, match="continuous"):

        @register_policy("continuous", NoConfig)
        class Impostor:
            def __init__(self, config):
                self.config = config

    assert type(make_policy("continuous")).__name__ == "ContinuousBatching"


def test_config_must_be_a_dataclass():
    with pytest.raises(TypeError):
        register_policy("not_a_dataclass_config", dict)


def test_package_reexports_the_contract():
    for name in ["ClusterSnapshot", "RequestView", "WorkerView", "WorkerPlan", "StepReport",
                 "RequestSpec", "RequestStatus", "ShapeKey", "PolicyError"]:
        assert hasattr(policies, name), name
