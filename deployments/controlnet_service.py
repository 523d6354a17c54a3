"""ControlNet as a service (SwiftDiffusion §4.1): ControlNets run in their own deployment, scaled
apart from the denoisers, while each worker's UNet runs its encoder half.

A call is one ControlNet's forward over the rows of every request of one worker's forward that
uses it; the worker sends the ControlNets of a step at once (to as many replicas as Serve routes
them to), and sums each request's residuals in its own order when they are back
(`engine.addons.controlnet`). Each replica keeps the `cache_size` most recently used ControlNets
in device memory (a few popular ones serve nearly every call) and loads a missing one from its
source.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stepserve.engine.families import resolve_device
from stepserve.engine.addons.controlnet import ControlRows, Residuals, inputs_to, net_residuals
from stepserve.engine.addons.source import AddonKind, AddonSource, controlnet_model
from stepserve.engine.families import ModelSource
from stepserve.engine.families.base import cast_module


class ControlNetService:
    def __init__(self, controlnets: Sequence[AddonSource], models: Sequence[ModelSource], device: str = "auto",
                 torch_threads: int | None = None, cache_size: int = 8):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = torch.device(resolve_device(device))
        self.sources = {(s.model, s.name): s for s in controlnets if s.kind is AddonKind.CONTROLNET}
        self.models = {m.name: m for m in models}
        self.cache_size = cache_size
        self.nets: OrderedDict[tuple[str, str], Any] = OrderedDict()  # LRU
        self.loads = 0
        # Serve runs calls on a thread pool: one load at a time (a preset draws its weights from
        # torch's global generator), and the LRU changes under it.
        self._lock = threading.Lock()
        for model, name in list(self.sources)[:cache_size]:  # the first configured: the popular ones
            self._net(model, name)

    def residuals(self, model: str, name: str, sample: torch.Tensor, timesteps: torch.Tensor,
                  inputs: Mapping[str, Any], images: torch.Tensor, rows: Sequence[int],
                  scales: Sequence[float]) -> list[Residuals]:
        """ControlNet `name` of `model` over `sample`'s rows: uses of `rows[i]` consecutive rows
        each (their control images stacked in `images`), each scaled by `scales[i]`; their
        residuals in order, on the host."""
        net = self._net(model, name)
        on = dict(device=self.device)
        group, start = [], 0
        for n, scale in zip(rows, scales):
            group.append(ControlRows(name, slice(start, start + n), images[start:start + n].to(**on, dtype=net.dtype),
                                     scale))
            start += n
        with torch.inference_mode():
            out = net_residuals(net, sample.to(**on), timesteps.to(**on), inputs_to(inputs, self.device), group)
            return [([d.cpu() for d in down], mid.cpu()) for down, mid in out]

    def _net(self, model: str, name: str) -> Any:
        key = (model, name)
        with self._lock:
            net = self.nets.get(key)
            if net is None:
                if key not in self.sources:
                    raise KeyError(f"ControlNet {name!r} is not served for model {model!r}")
                source = self.models[model]
                net = controlnet_model(self.sources[key], source).to(self.device).eval().requires_grad_(False)
                cast_module(net, source.torch_dtype)
                self.loads += 1
                self.nets[key] = net
                while len(self.nets) > self.cache_size:
                    self.nets.popitem(last=False)
            self.nets.move_to_end(key)
            return net

