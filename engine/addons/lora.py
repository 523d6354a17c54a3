"""LoRAs kept apart from the base weights, so one forward can serve requests with different LoRAs
(SwiftDiffusion §4.2 merges one LoRA in place; a step-level batch mixes requests, so each
request's low-rank update is added to its own rows instead).

A targeted layer computes `W x` for every row, then, for each LoRA in the forward, one batched
`B (A x)` over the rows of the requests that use it, scaled per row by the request's scale times
the LoRA's `alpha / rank`, and added to those rows. That equals diffusers' `load_lora_weights` +
`fuse_lora` (which adds `scale * alpha / rank * B @ A` to `W`) up to float rounding.

A LoRA file is read with diffusers' own `lora_state_dict` (safetensors only, local only), so
the key formats it converts (kohya, PEFT, diffusers) are the ones served.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import StableDiffusionPipeline  # its LoRA reader (`lora_state_dict`) is the SD/SDXL one
from torch import nn

DENOISER_PREFIX = "unet."  # what diffusers' SD/SDXL LoRA files prefix the UNet's layers with


@dataclass(frozen=True)
class LoraLayer:
    """One targeted layer's update: `B (A x)` times `scaling` (= alpha / rank)."""

    down: torch.Tensor  # A: [rank, in] (Linear) or [rank, in, kh, kw] (Conv2d)
    up: torch.Tensor  # B: [out, rank] or [out, rank, 1, 1]
    scaling: float


@dataclass(frozen=True)
class LoraWeights:
    """A LoRA's updates, by the name of the denoiser module each targets."""

    name: str
    layers: dict[str, LoraLayer]

    @classmethod
    def from_state_dict(cls, name: str, state: dict[str, torch.Tensor], alphas: dict[str, float] | None,
                        metadata: dict | None) -> "LoraWeights":
        """From diffusers' converted state dict (`lora_A` / `lora_B` keys), with alphas as diffusers
        reads them: kohya `network_alphas`, else the adapter config saved with the file, else
        alpha = rank (scale 1)."""
        text = sorted({key.split(".", 1)[0] for key in state if not key.startswith(DENOISER_PREFIX)})
        if text:
            raise ValueError(f"LoRA {name!r} has layers for {text}; only denoiser LoRAs are served")
        if any("lora_magnitude_vector" in key or ("lora_B" in key and key.endswith(".bias")) for key in state):
            raise ValueError(f"LoRA {name!r} is a DoRA or has LoRA biases; only plain LoRAs are served")
        modules = sorted({key[len(DENOISER_PREFIX):].rsplit(".lora_", 1)[0] for key in state})
        # The adapter config diffusers saves with a file, its keys prefixed as the layers' are.
        config = {key[len(DENOISER_PREFIX):]: value for key, value in (metadata or {}).items()
                  if key.startswith(DENOISER_PREFIX)}
        layers = {}
        for module in modules:
            down = state[f"{DENOISER_PREFIX}{module}.lora_A.weight"]
            up = state[f"{DENOISER_PREFIX}{module}.lora_B.weight"]
            rank = down.shape[0]
            alpha = _alpha(module, rank, alphas, config)
            layers[module] = LoraLayer(down, up, alpha / rank)
        return cls(name, layers)

    def to(self, device: torch.device, dtype: torch.dtype) -> "LoraWeights":
        return LoraWeights(self.name, {module: LoraLayer(layer.down.to(device, dtype), layer.up.to(device, dtype),
                                                         layer.scaling) for module, layer in self.layers.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.down, layer.up))


# A LoRA as the node's LoRA store hands it out (actors.lora_store): (name, {module: (down, up, scaling)}) in numpy.
LoraArrays = tuple[str, dict[str, tuple[np.ndarray, np.ndarray, float]]]


def to_arrays(lora: LoraWeights) -> LoraArrays:
    return lora.name, {m: (layer.down.numpy(), layer.up.numpy(), layer.scaling) for m, layer in lora.layers.items()}


def from_arrays(arrays: LoraArrays) -> LoraWeights:
    """The weights, as tensors over the arrays' memory (read-only: the object store's; nothing
    writes LoRA weights, so torch's warning about it is silenced)."""
    name, layers = arrays
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return LoraWeights(name, {m: LoraLayer(torch.from_numpy(down), torch.from_numpy(up), scaling)
                                  for m, (down, up, scaling) in layers.items()})


def _alpha(module: str, rank: int, alphas: dict[str, float] | None, config: dict) -> float:
    if alphas:
        for key in (f"{DENOISER_PREFIX}{module}.alpha", f"{module}.alpha"):
            if key in alphas:
                return float(alphas[key])
        raise ValueError(f"LoRA layer {module!r} has no alpha among the file's network alphas")
    if config:
        pattern = config.get("alpha_pattern") or {}
        for key, value in pattern.items():  # PEFT patterns name a module by a suffix of its path
            if module == key or module.endswith("." + key):
                return float(value)
        return float(config.get("lora_alpha", rank))
    return float(rank)


def load_lora_file(name: str, path: str) -> LoraWeights:
    """A LoRA from a local `.safetensors` file, or a folder holding diffusers'
    `pytorch_lora_weights.safetensors`. Never from a hub."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"LoRA {name!r}: {path!r} does not exist")
    if os.path.isfile(path) and not path.endswith(".safetensors"):
        raise ValueError(f"LoRA {name!r}: only .safetensors files are served, not {path!r}")
    folder, file = (os.path.dirname(path), os.path.basename(path)) if os.path.isfile(path) else (path, None)
    state, alphas, metadata = StableDiffusionPipeline.lora_state_dict(
        folder, weight_name=file, use_safetensors=True, local_files_only=True, return_lora_metadata=True,
    )
    return LoraWeights.from_state_dict(name, state, alphas, metadata)


class LoraLoader(Protocol):
    """Brings LoRAs into a worker's families while it steps (the worker's side of the LoRA store):
    a request may start before its LoRA has arrived (SwiftDiffusion's bounded asynchronous
    loading). Every method adds what has arrived to its model's family (`add_lora`)."""

    def request(self, model: str, name: str) -> None:
        """Start bringing it here, if it is not here or coming."""

    def poll(self) -> None:
        """Add whatever has arrived; never waits."""

    def wait(self, model: str, name: str) -> None:
        """Block until it is here; raises if it cannot come."""

    def trim(self, keep: set[tuple[str, str]]) -> None:
        """Drop LoRAs beyond the worker's capacity, never those in `keep` (model, name)."""


@dataclass(frozen=True)
class LoraRows:
    """One request's use of one LoRA in a forward."""

    name: str
    rows: slice  # the request's rows of the forward's batch
    scale: float


def _update(layer: LoraLayer, base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(base, nn.Conv2d):
        hidden = F.conv2d(x, layer.down, stride=base.stride, padding=base.padding, dilation=base.dilation)
        return F.conv2d(hidden, layer.up)
    return F.linear(F.linear(x, layer.down), layer.up)


@dataclass(frozen=True)
class _Rows:
    """One LoRA's rows in a forward, prepared once for all the layers it targets."""

    index: torch.Tensor | None  # None: every row of the batch, in order
    scales: torch.Tensor | float  # the request scale per row ([n, 1, ...] as the output), or one for all

    @classmethod
    def of(cls, uses: Sequence[LoraRows], batch: int, device: torch.device) -> "_Rows":
        index = torch.cat([torch.arange(u.rows.start, u.rows.stop) for u in uses])
        all_rows = len(index) == batch and bool((index == torch.arange(batch)).all())
        if len({u.scale for u in uses}) == 1:
            scales: torch.Tensor | float = uses[0].scale
        else:
            scales = torch.cat([torch.full((u.rows.stop - u.rows.start,), u.scale) for u in uses]).to(device)
        return cls(None if all_rows else index.to(device), scales)


@contextmanager
def lora_rows(denoiser: nn.Module, loras: dict[str, LoraWeights], uses: Sequence[LoraRows],
              batch: int | None = None) -> Iterator[None]:
    """While open, `denoiser`'s forwards (of `batch` rows) add each use's update to its rows.
    Hooks are installed only for the layers this forward's LoRAs target, and removed after."""
    by_lora: dict[str, list[LoraRows]] = {}
    for use in uses:
        if use.scale != 0.0:
            by_lora.setdefault(use.name, []).append(use)
    if not by_lora:
        yield
        return
    device = next(denoiser.parameters()).device
    batch = batch if batch is not None else max(u.rows.stop for u in uses)
    by_module: dict[str, list[tuple[LoraLayer, _Rows]]] = {}
    for lora_name, lora_uses in by_lora.items():
        rows = _Rows.of(lora_uses, batch, device)
        for module, layer in loras[lora_name].layers.items():
            by_module.setdefault(module, []).append((layer, rows))
    handles = []
    try:
        for module, updates in by_module.items():
            handles.append(denoiser.get_submodule(module).register_forward_hook(_hook(updates)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hook(updates: list[tuple[LoraLayer, _Rows]]):
    def add_updates(base: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        # `output` is the layer's own fresh tensor, seen by nobody yet: updated in place.
        x = args[0]
        for layer, rows in updates:
            update = _update(layer, base, x if rows.index is None else x.index_select(0, rows.index))
            if isinstance(rows.scales, float):
                update = update * (rows.scales * layer.scaling)
            else:
                update = update * (rows.scales * layer.scaling).to(output.dtype).view(-1, *[1] * (output.dim() - 1))
            if rows.index is None:
                output.add_(update)
            else:
                output.index_add_(0, rows.index, update)
        return output
    return add_updates
