"""Starts the denoiser workers as Ray actors with the resources the config asks for."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from stepserve.actors.activation_store import ActivationStoreSpec
from stepserve.actors.denoiser import CONTROL, DenoiserWorker
from stepserve.actors.lora_store import LoraStore
from stepserve.actors.node_stores import start_per_node
from stepserve.engine.addons.source import AddonKind, AddonSource
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.families import ModelSource
from stepserve.engine.patch_cache.calibration import PatchCacheSpec


@dataclass(frozen=True)
class WorkerPoolSpec:
    num_workers: int = 2
    max_batch_size: int = 8
    num_cpus: float = 0.5
    num_gpus: float = 0
    device: str = "auto"
    torch_threads: int | None = None
    pack_resolutions: bool = False  # `workers.pack_resolutions`: a plan's plain groups of a model in one forward
    decode_images: bool = False  # a finished image leaves its worker as a PNG (`vae_decoder.on_workers`)
    encode_text: bool = False  # a worker encodes the prompts of what it admits (`text_encoder.on_workers`)
    text_cache_size: int = 4096  # embeddings each worker keeps when it encodes prompts
    addons: tuple[AddonSource, ...] = ()  # ControlNets and LoRAs every worker serves (`controlnets`, `loras`)
    lora_join_by: float = 0.0  # `lora_loading.join_by`
    lora_store_bytes: int = 8 << 30  # `lora_loading.store_bytes`
    max_resident_loras: int = 32  # `lora_loading.max_resident`
    preload_loras: bool = False  # `lora_loading.preload`: every worker loads every LoRA at start, no stores
    controlnet_stale: bool = False  # `controlnet_service.stale`
    edit_cache: ActivationStoreSpec | None = None  # `edit_cache` when enabled: each node's activation store
    edit_cache_kind: CacheKind = CacheKind.KEYS_VALUES  # `edit_cache.cache`: what a template's record holds
    edit_cache_worker_bytes: int = 4 << 30  # `edit_cache.worker_bytes`: each worker's LRU of records it used
    patch_cache: PatchCacheSpec | None = None  # `patch_cache` when enabled: each worker calibrates and serves it

    @property
    def loras(self) -> tuple[AddonSource, ...]:
        return tuple(a for a in self.addons if a.kind is AddonKind.LORA)


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
                 spec.text_cache_size if spec.encode_text else None, spec.addons, lora_stores or {},
                 spec.lora_join_by, spec.max_resident_loras, controlnet_service, spec.controlnet_stale,
                 activation_stores or {}, spec.edit_cache_kind, spec.edit_cache_worker_bytes, spec.pack_resolutions,
                 spec.patch_cache)
    return workers, names
