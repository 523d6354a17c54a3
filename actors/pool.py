"""Starts the denoiser workers as Ray actors with the resources the config asks for."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Sequence

import ray

from stepserve.actors.denoiser import CONTROL, DenoiserWorker
from stepserve.engine.addons.source import AddonSource
from stepserve.engine.families import ModelSource


@dataclass(frozen=True)
class WorkerPoolSpec:
    num_workers: int = 2
    max_batch_size: int = 8
    num_cpus: float = 0.5
    num_gpus: float = 0
    device: str = "auto"
    torch_threads: int | None = None
    decode_images: bool = False  # a finished image leaves its worker as a PNG (`vae_decoder.on_workers`)
    encode_text: bool = False  # a worker encodes the prompts of what it admits (`text_encoder.on_workers`)
    text_cache_size: int = 4096  # embeddings each worker keeps when it encodes prompts
    addons: tuple[AddonSource, ...] = ()  # ControlNets and LoRAs every worker serves (`controlnets`, `loras`)


def start_workers(spec: WorkerPoolSpec, models: Sequence[ModelSource],
                  name_prefix: str) -> tuple[dict[str, ray.actor.ActorHandle], dict[str, str]]:
    """Create the workers; each loads its models in its constructor (await `ready` to know).
    Returns their handles and their actor names, by worker id.

    Each is a named actor, `<prefix>-w<i>-<token>`, so an operator can find it with `ray list
    actors`; the token keeps a restarted router's workers apart from the ones its predecessor is
    still tearing down."""
    # One plan at a time; an interrupt runs beside it (Ray takes concurrency groups only here).
    remote_cls = ray.remote(concurrency_groups={CONTROL: 1})(DenoiserWorker)
    token = uuid.uuid4().hex[:8]
    workers, names = {}, {}
    for i in range(spec.num_workers):
        worker_id = f"{name_prefix}-w{i}"
        names[worker_id] = f"{worker_id}-{token}"
        workers[worker_id] = remote_cls.options(
            # A crashed worker comes back (reloading its models); the router resumes what it held.
            name=names[worker_id], num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=-1,
            max_concurrency=1,
        ).remote(worker_id, list(models), spec.device, spec.torch_threads, spec.decode_images,
                 spec.text_cache_size if spec.encode_text else None, spec.addons)
    return workers, names
