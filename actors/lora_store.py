"""The LoRA store: one actor per node holding LoRA weights in host memory, shared by the node's
workers (SwiftDiffusion §4.2: LoRAs are loaded off the serving process and handed over through
shared memory).

LoRAs are many and long-tailed, so none is loaded up front: the first `fetch` of one reads its
safetensors file (in a thread: the store keeps answering), and the weights then wait in Ray's
object store as numpy arrays, which a worker on the same node maps without a copy. The store
keeps the most recently used up to `capacity_bytes` and lets the rest go (Ray frees an object
once no worker holds it either).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from stepserve.engine.addons.lora import LoraWeights, from_arrays, load_lora_file, to_arrays
from stepserve.engine.addons.presets import preset_lora
from stepserve.engine.addons.source import AddonKind, AddonSource
from stepserve.engine.families import DENOISER, ModelSource, load_family
from stepserve.routing.lora_residency import LoraResidency

class LoraStore:
    def __init__(self, loras: Sequence[AddonSource], models: Sequence[ModelSource], capacity_bytes: int):
        """`loras`: the catalog (every servable LoRA); `models`: their base models (a preset
        LoRA is built over its model's denoiser, so the store builds that denoiser once, on the
        host, when it first needs it)."""
        self.catalog = {(s.model, s.name): s for s in loras if s.kind is AddonKind.LORA}
        self.models = {m.name: m for m in models}
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()  # LRU: (ref, bytes)
        self._loading: dict[tuple[str, str], asyncio.Future] = {}
        self._denoisers: dict[str, torch.nn.Module] = {}
        self._building = threading.Lock()
        self.loads = 0  # files read (or presets built): what a cache miss costs

    async def fetch(self, model: str, name: str) -> list:
        """[object ref of the LoRA's `LoraArrays`] (in a list: a ref returned bare would be
        resolved), loading it first if it is not held."""
        key = (model, name)
        if key not in self.catalog:
            raise KeyError(f"LoRA {name!r} is not served for model {model!r}")
        held = self._held.get(key)
        if held is None:
            loading = self._loading.get(key)
            if loading is None:  # one read per LoRA however many ask for it meanwhile
                loading = self._loading[key] = asyncio.ensure_future(self._load(key))
                loading.add_done_callback(lambda _: self._loading.pop(key, None))
            held = await asyncio.shield(loading)  # a failed read fails its waiters; the next fetch retries
        else:
            self._held.move_to_end(key)
        return [held[0]]

    async def prefetch(self, model: str, names: Sequence[str]) -> None:
        """Returns once every LoRA of `names` is held (loading those that are not)."""
        await asyncio.gather(*(self.fetch(model, name) for name in names))

    def held(self) -> list[tuple[str, str]]:
        """(model, name) of the LoRAs held, least recently used first."""
        return list(self._held)

    async def _load(self, key: tuple[str, str]) -> tuple[Any, int]:
        lora = await asyncio.to_thread(self._read, self.catalog[key])
        arrays = to_arrays(lora)
        ref = ray.put(arrays)
        self._held[key] = (ref, lora.nbytes)
        self.loads += 1
        self._evict()
        return self._held[key]

    def _read(self, source: AddonSource) -> LoraWeights:
        if source.path is not None:
            return load_lora_file(source.name, source.path)
        with self._building:  # reads run on threads; a preset's denoiser is built once
            denoiser = self._denoisers.get(source.model)
            if denoiser is None:
                denoiser = self._denoisers[source.model] = load_family(self.models[source.model], {DENOISER}).denoiser
        return preset_lora(source.name, denoiser, source.seed)

    def _evict(self) -> None:
        total = sum(size for _, size in self._held.values())
        while total > self.capacity_bytes and len(self._held) > 1:
            _, (_, size) = self._held.popitem(last=False)
            total -= size


class StoreLoras:
    """A worker's `LoraLoader` over its node's store: what a plan's requests need is fetched in
    the background and added to its family when it has arrived; at most `max_resident` LoRAs
    stay in the worker's memory, the least recently used not in use going first."""

    def __init__(self, store: Any, families: Mapping[str, Any], max_resident: int):
        self.store = store
        self.families = families
        self._coming: dict[tuple[str, str], Any] = {}  # (model, name) -> ref of the store's answer
        self._resident = LoraResidency(max_resident)  # what is installed, least recently used first

    def request(self, model: str, name: str) -> None:
        key = (model, name)
        if name in self.families[model].loras:
            self._resident.use(key)
        elif key not in self._coming:
            self._coming[key] = self.store.fetch.remote(model, name)

    def poll(self) -> None:
        if not self._coming:
            return
        ready, _ = ray.wait(list(self._coming.values()), num_returns=len(self._coming), timeout=0)
        ready = set(ready)
        for key in [key for key, ref in self._coming.items() if ref in ready]:
            self._install(key)

    def wait(self, model: str, name: str) -> None:
        if name in self.families[model].loras:
            return
        self.request(model, name)
        self._install((model, name))

    def trim(self, keep: set[tuple[str, str]]) -> None:
        for model, name in self._resident.trim(keep):
            self.families[model].remove_lora(name)

    def _install(self, key: tuple[str, str]) -> None:
        ref = self._coming.pop(key)
        try:
            (arrays_ref,) = ray.get(ref)
            lora = from_arrays(ray.get(arrays_ref))
        except ray.exceptions.RayTaskError as exc:  # the store's own error (no such LoRA, a bad file)
            raise RuntimeError(f"LoRA {key[1]!r} could not be loaded: {exc.cause or exc}") from None
        self.families[key[0]].add_lora(lora)
        self._resident.use(key)
