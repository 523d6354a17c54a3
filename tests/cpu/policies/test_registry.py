"""Policy lookup by name: what configs, the router and the simulator rely on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import stepserve.policies as policies
from stepserve.policies import PerWorker, Scheduler, WorkerPolicy, make_policy, needs_costs, policy_names
from stepserve.policies.genserve import GenServeConfig
from stepserve.policies.genserve.policy import GenServePolicy
from stepserve.policies.registry import register_policy, validate_policy

from tests.cpu.policies.genserve.fakes import FakeCosts

PER_WORKER = ["continuous", "static_fcfs", "dynamic_batching"]


def test_builtin_policies_are_registered():
    names = policy_names()
    assert set(PER_WORKER + ["genserve"]) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("name", PER_WORKER)
def test_make_policy_wraps_a_per_worker_policy_in_a_scheduler(name):
    policy = make_policy(name)
    assert isinstance(policy, Scheduler) and isinstance(policy, PerWorker)
    assert isinstance(policy.policy, WorkerPolicy)
    assert policy.name == name
    assert make_policy(name, {"max_batch_size": 3}).policy.config.max_batch_size == 3
    assert make_policy(name, None).policy.config.max_batch_size is None


@pytest.mark.parametrize("name", PER_WORKER)
def test_per_worker_policies_need_no_costs_and_ignore_them(name):
    assert needs_costs(name) is False
    assert isinstance(make_policy(name, None, FakeCosts()), PerWorker)


def test_genserve_is_a_scheduler_built_with_costs():
    costs = FakeCosts()
    policy = make_policy("genserve", {"image_max_batch": 4}, costs)
    # A whole-pool scheduler is not wrapped: PerWorker would ask it worker by worker.
    assert isinstance(policy, GenServePolicy) and isinstance(policy, Scheduler)
    assert not isinstance(policy, PerWorker)
    assert policy.name == "genserve"
    assert policy.base_costs is costs
    assert policy.config == GenServeConfig(image_max_batch=4)
    assert needs_costs("genserve") is True


def test_genserve_without_costs_says_where_they_come_from():
    with pytest.raises(ValueError, match="router.profiles") as info:
        make_policy("genserve")
    assert "genserve" in str(info.value)


def test_sp_degrees_from_yaml_list_becomes_a_tuple():
    options = {"sp_degrees": [1, 2, 4], "fixed_sp_degree": 2}
    config = validate_policy("genserve", options)
    assert config.sp_degrees == (1, 2, 4) and config.fixed_sp_degree == 2
    assert options == {"sp_degrees": [1, 2, 4], "fixed_sp_degree": 2}  # the caller's dict is left alone
    assert make_policy("genserve", options, FakeCosts()).config.sp_degrees == (1, 2, 4)


def test_genserve_invalid_option_value_is_named():
    with pytest.raises(ValueError, match="sp_degrees"):
        validate_policy("genserve", {"sp_degrees": [2, 1]})
    with pytest.raises(ValueError, match="fixed_sp_degree"):
        make_policy("genserve", {"sp_degrees": [1, 2], "fixed_sp_degree": 4}, FakeCosts())


@pytest.mark.parametrize("name", PER_WORKER + ["genserve"])
def test_validate_policy_returns_the_config_it_would_build(name):
    config = validate_policy(name)
    assert config == type(config)()  # no options: the defaults
    assert validate_policy(name, {}) == config


def test_unknown_name_lists_known_names():
    for call in (lambda: make_policy("round_robin"), lambda: validate_policy("round_robin"),
                 lambda: needs_costs("round_robin")):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "round_robin" in message
        assert all(name in message for name in PER_WORKER + ["genserve"])


@pytest.mark.parametrize("name", PER_WORKER + ["genserve"])
def test_unknown_option_is_named(name):
    with pytest.raises(ValueError, match="max_batch'") as info:
        make_policy(name, {"max_batch": 4}, FakeCosts())
    message = str(info.value)
    assert name in message
    valid = "image_max_batch" if name == "genserve" else "max_batch_size"
    assert valid in message  # the valid spellings are listed
    with pytest.raises(ValueError, match="max_batch'"):
        validate_policy(name, {"max_batch": 4})


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
            joins_running = True

            def __init__(self, config):
                self.config = config

            def plan(self, snapshot, worker_id):
                raise AssertionError("never called")

    assert type(make_policy("continuous").policy).__name__ == "ContinuousBatching"


def test_a_class_that_cannot_schedule_is_rejected():
    @dataclass(frozen=True)
    class NoConfig:
        pass

    with pytest.raises(TypeError, match="neither schedule"):

        @register_policy("cannot_schedule", NoConfig)
        class Nothing:
            pass

    assert "cannot_schedule" not in policy_names()


def test_a_policy_must_say_what_the_router_may_do_around_its_plans():
    @dataclass(frozen=True)
    class NoConfig:
        pass

    with pytest.raises(TypeError, match="must declare joins_running"):

        @register_policy("silent_worker_policy", NoConfig)
        class Silent:
            def plan(self, snapshot, worker_id):
                raise AssertionError("never called")

    with pytest.raises(TypeError, match="must declare steady and joins_running"):

        @register_policy("silent_scheduler", NoConfig)
        class SilentScheduler:
            def schedule(self, snapshot):
                raise AssertionError("never called")

    assert "silent_worker_policy" not in policy_names() and "silent_scheduler" not in policy_names()
    assert make_policy("continuous").joins_running and not make_policy("static_fcfs").joins_running


def test_config_must_be_a_dataclass():
    with pytest.raises(TypeError):
        register_policy("not_a_dataclass_config", dict)
    assert "not_a_dataclass_config" not in policy_names()


def test_package_reexports_the_contract():
    for name in ["ClusterSnapshot", "RequestView", "WorkerView", "WorkerPlan", "StepGroup", "Decision", "StepReport",
                 "RequestSpec", "RequestStatus", "RequestKind", "ShapeKey", "PolicyError", "Scheduler",
                 "WorkerPolicy", "PerWorker", "make_policy", "needs_costs", "policy_names"]:
        assert hasattr(policies, name), name


def test_options_for_keeps_what_the_other_policy_takes():
    from stepserve.policies import options_for

    composed = {"sp_degrees": [1, 2], "refuse_unattainable": False, "headroom_quantile": 0.5}
    assert options_for("genserve", composed) == {"sp_degrees": [1, 2]}
    assert options_for("continuous", composed) == {}
    assert options_for("composed", composed) == composed
    with pytest.raises(ValueError, match="unknown policy"):
        options_for("nope", composed)


def test_options_for_workers_batch_and_pack_as_the_workers_do_unless_told():
    from stepserve.policies import options_for_workers

    assert options_for_workers("composed", {}, 12) == {"image_max_batch": 12, "pack_resolutions": False}
    assert options_for_workers("genserve", {"image_max_batch": 4}, 12, True) == {"image_max_batch": 4,
                                                                                  "pack_resolutions": True}
    assert options_for_workers("genserve", {"pack_resolutions": False}, 12, True)["pack_resolutions"] is False
    # A policy that takes neither keeps its options as given (continuous batches per worker).
    assert options_for_workers("continuous", {"max_batch_size": 3}, 12, True) == {"max_batch_size": 3}


def test_the_simulator_builds_its_policy_as_the_served_app_does():
    """A composed spine in the simulator batches to the workers' cap and packs where they pack,
    as `AppConfig.policy_options` makes the served one do (it once stopped at the config
    default 8 under a cap of 12)."""
    from stepserve.load_tests.sim import SimConfig
    from stepserve.load_tests.sim.simulator import Simulation
    from stepserve.policies.cost_model import load_profile

    sim = Simulation([], load_profile("sdxl-h800"), SimConfig(workers=1, max_batch_size=12, policy="composed"))
    assert sim.core.policy.config.image_max_batch == 12 and not sim.core.policy.config.pack_resolutions
    packing = SimConfig(workers=1, policy="composed", packing=("stable-diffusion-xl-base-1.0",))
    assert Simulation([], load_profile("sdxl-h800"), packing).core.policy.config.pack_resolutions
