"""Starts the denoiser workers as Ray actors with the resources the config asks for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ray

from ..engine.families import ModelSource
from .denoiser import DenoiserWorker


@dataclass(frozen=True)
class WorkerPoolSpec:
    num_workers: int = 2
    max_batch_size: int = 8
    num_cpus: float = 0.5
    num_gpus: float = 0
    device: str = "auto"
    torch_threads: int | None = None


def start_workers(spec: WorkerPoolSpec, models: Sequence[ModelSource], name_prefix: str) -> dict[str, ray.actor.ActorHandle]:
    """Create the workers; each loads its models in its constructor (await `ready` to know)."""
    remote_cls = ray.remote(DenoiserWorker)
    workers = {}
    for i in range(spec.num_workers):
        worker_id = f"{name_prefix}-w{i}"
        workers[worker_id] = remote_cls.options(
            # A crashed worker comes back (reloading its models); the router fails what it held.
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=-1, max_concurrency=1,
        ).remote(worker_id, list(models), spec.device, spec.torch_threads)
    return workers
