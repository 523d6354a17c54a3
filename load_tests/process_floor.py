"""stepserve's processes with nothing in them: what Ray and Serve charge for them, idle.

Idle, an app costs at least what its processes cost: every Ray worker process does periodic
work of its own (its core worker's timers and gRPC), and every Serve replica a little more
(health checks, metrics export). This app has stepserve's process layout and nothing else: the
ingress, router and job store deployments with the options `build_app` gives them (CPUs,
replica environment, access logs), and the router's denoiser workers as plain actors with
theirs, each answering only `ready`. stepserve's idle CPU above this app's is what stepserve's
own code burns idle; `bench_peers` measures both.

    build_floor_app(app_config_args)   # or import_path in a Serve YAML, with a stepserve app's args
"""

# No `from __future__ import annotations`: FastAPI must see real annotations on the route.
import asyncio
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from stepserve.actors.denoiser import CONTROL
from stepserve.deployments.app import INTERNAL_LOGGING, LONG_CALLS, actor_options
from stepserve.deployments.config import AppConfig

api = FastAPI(title="stepserve process floor")


class FloorWorker:
    def ready(self) -> bool:
        return True


class FloorRouter:
    async def __init__(self, num_workers: int, num_cpus: float, num_gpus: float):
        # As `actors.pool.WorkerLauncher` makes them: one call at a time, a control group beside it.
        remote_cls = ray.remote(concurrency_groups={CONTROL: 1})(FloorWorker)
        self.workers = [remote_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1).remote()
                        for _ in range(num_workers)]
        await asyncio.gather(*(w.ready.remote() for w in self.workers))


class FloorStore:
    pass


@serve.ingress(api)
class FloorIngress:
    def __init__(self, router: Any, store: Any):
        self.router, self.store = router, store

    @api.get("/ready")
    async def ready(self) -> dict[str, str]:
        return {"status": "ready"}


def build_floor_app(args: dict[str, Any] | AppConfig) -> Application:
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    internal = {"num_replicas": 1, "max_ongoing_requests": LONG_CALLS, "logging_config": INTERNAL_LOGGING,
                "ray_actor_options": actor_options(config, 0)}
    workers = config.workers
    store = serve.deployment(FloorStore, name="JobStore").options(**internal).bind()
    router = serve.deployment(FloorRouter, name="Router").options(**internal).bind(
        workers.num_workers, workers.num_cpus, workers.num_gpus)
    ing = config.ingress
    return serve.deployment(FloorIngress, name="Ingress").options(
        num_replicas=ing.num_replicas, max_ongoing_requests=LONG_CALLS,
        ray_actor_options=actor_options(config, ing.num_cpus, ing.num_gpus),
    ).bind(router, store)
