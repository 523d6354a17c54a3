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


class WorkerLauncher:
    """Starts denoiser workers one at a time, each loading its models in its constructor (await
    its `ready` to know); the router starts its first ones at once and more as its pool grows.
    `services`: the LoRA stores, ControlNet deployment and activation stores the router started.

    Each is a named actor, `<prefix>-w<i>-<token>`, so an operator can find it with `ray list
    actors`; the token keeps a restarted router's workers apart from the ones its predecessor is
    still tearing down. Indexes are never reused: a worker's id names one actor for its life."""

    def __init__(self, spec: WorkerPoolSpec, models: Sequence[ModelSource], name_prefix: str,
                 services: WorkerServices) -> None:
        # One plan at a time; an interrupt, and a chunked decode, run beside it (Ray takes
        # concurrency groups only here).
        self._remote_cls = ray.remote(concurrency_groups={CONTROL: 1, DECODE: 1})(DenoiserWorker)
        self.spec, self.models, self.prefix, self.services = spec, list(models), name_prefix, services
        self._token = uuid.uuid4().hex[:8]
        self._next = 0

    def start(self) -> tuple[int, str, str, ray.actor.ActorHandle]:
        """Create the next worker: its index (its rank), id, actor name and handle."""
        index, self._next = self._next, self._next + 1
        worker_id = f"{self.prefix}-w{index}"
        name = f"{worker_id}-{self._token}"
        spec = self.spec
        handle = self._remote_cls.options(
            # A crashed worker comes back (reloading its models); the router resumes what it held.
            name=name, num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=dict(spec.resources) or None,
            max_restarts=-1, max_concurrency=1,
        ).remote(worker_id, self.models, spec, self.services)
        return index, worker_id, name, handle
