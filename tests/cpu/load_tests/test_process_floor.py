"""The process floor has stepserve's process layout: the same deployments with the same options."""

from __future__ import annotations

from stepserve.deployments.app import build_app
from stepserve.deployments.config import AppConfig
from stepserve.load_tests.process_floor import build_floor_app

from tests.cpu.deployments.test_app import app_args, deployments


def test_the_floor_has_stepserves_deployments_with_their_options():
    stepserve, floor = deployments(build_app(app_args())), deployments(build_floor_app(app_args()))
    assert set(floor) == set(stepserve) == {"Ingress", "Router", "JobStore"}
    for name in floor:
        for option in ("ray_actor_options", "num_replicas", "max_ongoing_requests", "logging_config"):
            assert getattr(floor[name], option) == getattr(stepserve[name], option), (name, option)


def test_the_floor_router_starts_the_configured_workers():
    config = AppConfig.model_validate(app_args())
    router = deployments(build_floor_app(config))["Router"]
    workers = config.workers
    assert router.init_args == (workers.num_workers, workers.num_cpus, workers.num_gpus)
