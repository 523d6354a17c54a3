"""Starts the denoiser workers as Ray actors with the resources the config asks for."""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import ray

from stepserve.actors.denoiser import CONTROL, DECODE, DenoiserWorker
from stepserve.actors.lora_store import LoraStore
from stepserve.actors.node_stores import start_per_node
from stepserve.actors.worker_options import WorkerPoolSpec, WorkerServices
from stepserve.engine.families import ModelSource


def start_lora_stores(spec: WorkerPoolSpec, models: Sequence[ModelSource], name_prefix: str) -> dict[str, Any]:
    """One LoRA store per live node (none when no LoRA is served, or all are preloaded), by node
    id: the workers of a node share its store's host memory."""
    if not spec.loras or spec.preload_loras:
        return {}
    return start_per_node(LoraStore, f"{name_prefix}-loras", lambda node: (spec.loras, list(models),
                                                                            spec.lora_store_bytes))


def start_workers(spec: WorkerPoolSpec, models: Sequence[ModelSource], name_prefix: str,
                  lora_stores: dict[str, Any] | None = None, controlnet_service: Any | None = None,
                  activation_stores: dict[str, Any] | None = None,
                  ) -> tuple[dict[str, ray.actor.ActorHandle], dict[str, str]]:
    """Create the workers; each loads its models in its constructor (await `ready` to know).
    Returns their handles and their actor names, by worker id. `lora_stores`: from
    `start_lora_stores`; `controlnet_service`: a handle to the ControlNet deployment, if any;
    `activation_stores`: from `start_activation_stores` (`edit_cache`), if any.

    Each is a named actor, `<prefix>-w<i>-<token>`, so an operator can find it with `ray list
    actors`; the token keeps a restarted router's workers apart from the ones its predecessor is
    still tearing down."""
    # One plan at a time; an interrupt, and a chunked decode, run beside it (Ray takes concurrency
    # groups only here).
    remote_cls = ray.remote(concurrency_groups={CONTROL: 1, DECODE: 1})(DenoiserWorker)
    services = WorkerServices(lora_stores or {}, controlnet_service, activation_stores or {})
    token = uuid.uuid4().hex[:8]
    workers, names = {}, {}
    for i in range(spec.num_workers):
        worker_id = f"{name_prefix}-w{i}"
        names[worker_id] = f"{worker_id}-{token}"
        workers[worker_id] = remote_cls.options(
            # A crashed worker comes back (reloading its models); the router resumes what it held.
            name=names[worker_id], num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=-1,
            max_concurrency=1,
        ).remote(worker_id, list(models), spec, services)
    return workers, names
