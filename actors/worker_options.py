"""What a denoiser worker is built from: the pool's options, one frozen value made once from the
app config (`deployments.config.AppConfig.pool_spec`), and the handles of the services the
router starts before its workers. A worker reads both in its constructor and changes neither."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stepserve.actors.activation_store import ActivationStoreSpec
from stepserve.engine.addons.source import AddonKind, AddonSource, LoraJoinBounds
from stepserve.engine.editing.loading_plan import LoadingPlanner
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.patch_cache.calibration import PatchCacheSpec
from stepserve.engine.round_sequencer import SequencerSpec
from stepserve.routing.pool_scaler import ScalingSpec


@dataclass(frozen=True)
class WorkerPoolSpec:
    num_workers: int = 2
    max_batch_size: int = 8
    num_cpus: float = 0.5
    num_gpus: float = 0
    resources: tuple[tuple[str, float], ...] = ()  # `workers.resources`: custom Ray resources, by name
    scaling: ScalingSpec | None = None  # `workers.autoscaling` (None: a fixed pool of num_workers)
    device: str = "auto"
    torch_threads: int | None = None
    pack_resolutions: bool = False  # `workers.pack_resolutions`: a plan's plain groups of a model in one forward
    decode_images: bool = False  # a finished image leaves its worker as a PNG (`vae_decoder.on_workers`)
    decode_chunks: int = 1  # `vae_decoder.chunks`: above 1, images decode in chunks beside the rounds
    # `vae_decoder.sequencer_profile`, `sequencer_alpha`, `load_controller`: SynerDiff's sequencer (None: none)
    sequencer: SequencerSpec | None = None
    encode_text: bool = False  # a worker encodes the prompts of what it admits (`text_encoder.on_workers`)
    text_cache_size: int = 4096  # embeddings each worker keeps when it encodes prompts
    addons: tuple[AddonSource, ...] = ()  # ControlNets and LoRAs every worker serves (`controlnets`, `loras`)
    lora_join_by: float = 0.0  # `lora_loading.join_by`: the bound of a LoRA without its own `join_by`
    lora_store_bytes: int = 8 << 30  # `lora_loading.store_bytes`
    max_resident_loras: int = 32  # `lora_loading.max_resident`
    preload_loras: bool = False  # `lora_loading.preload`: every worker loads every LoRA at start, no stores
    controlnet_stale: bool = False  # `controlnet_service.stale`
    edit_cache: ActivationStoreSpec | None = None  # `edit_cache` when enabled: each node's activation store
    edit_cache_kind: CacheKind = CacheKind.KEYS_VALUES  # `edit_cache.cache`: what a template's record holds
    edit_cache_worker_bytes: int = 4 << 30  # `edit_cache.worker_bytes`: each worker's LRU of records it used
    # `edit_cache.loading` over the block costs of `router.profiles`: the slots a masked forward loads
    edit_cache_loading: LoadingPlanner = LoadingPlanner()
    patch_cache: PatchCacheSpec | None = None  # `patch_cache` when enabled: each worker calibrates and serves it

    @property
    def loras(self) -> tuple[AddonSource, ...]:
        return tuple(a for a in self.addons if a.kind is AddonKind.LORA)

    @property
    def bundle(self) -> dict[str, float]:
        """What one worker reserves, as Ray's autoscaler reads a resource request."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **dict(self.resources)}
        return {name: amount for name, amount in bundle.items() if amount}

    @property
    def lora_bounds(self) -> LoraJoinBounds:
        """How late each served LoRA may join a request: its own `join_by`, else the pool's."""
        return LoraJoinBounds.of(self.loras, self.lora_join_by)


@dataclass(frozen=True)
class WorkerServices:
    """Handles of what the router started for its workers: LoRA stores and activation stores by
    node id (`start_lora_stores`, `start_activation_stores`; empty: none), and the ControlNet
    deployment (None: each worker runs its ControlNets itself)."""

    lora_stores: Mapping[str, Any] = field(default_factory=dict)
    controlnet_service: Any | None = None
    activation_stores: Mapping[str, Any] = field(default_factory=dict)
