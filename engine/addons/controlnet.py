"""ControlNet residuals for one batched denoiser forward (SwiftDiffusion §4.1).

Each ControlNet runs once per forward over the rows of every request that uses it at this step,
whatever else those requests use; each request's residuals are then the sum of its ControlNets'
in the order it named them, as diffusers' `MultiControlNetModel` sums them, and rows of requests
without ControlNets get zeros (adding zeros leaves the UNet's skip tensors as they were). The
scale is applied after the forward, per request: `ControlNetModel` multiplies by a Python float,
and multiplying by 1.0 first changes nothing, so a request's residuals have the same floats as
the pipeline's.

Control images are resized where requests are validated (`control_pixels`) and made tensors when
a worker admits the request (`control_tensor`), never in the step loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import PIL.Image
import torch
from diffusers import ControlNetModel
from diffusers.image_processor import VaeImageProcessor

# Residuals for the UNet: one tensor per skip connection of its down blocks, and the mid block's.
Residuals = tuple[list[torch.Tensor], torch.Tensor]


class StaleResiduals:
    """One request's use of one ControlNet, one step stale (the add-on mode
    `engine.addon_modes.stale_controlnet`): what the family's service forward keeps between the
    request's steps. The residuals are kept unscaled; a step scales them by its own scale."""

    def __init__(self) -> None:
        self.ready: Residuals | None = None  # of the previous step's input
        self.coming: Callable[[], Residuals] | None = None  # of this step's input, being computed

    def clear(self) -> None:
        self.ready = self.coming = None


@dataclass(frozen=True)
class ControlRows:
    """One request's use of one ControlNet in a forward."""

    name: str
    rows: slice  # the request's rows of the forward's batch
    image: torch.Tensor  # [rows, 3, H, W] in [0, 1]: one copy per row, as the pipelines repeat it under CFG
    scale: float  # conditioning scale at this step (0 outside its start/end: it contributes nothing)
    stale: StaleResiduals | None = None  # set when the ControlNet may be one step stale
    last: bool = False  # the request's last step: nothing to compute for a next one


def control_residuals(
    nets: Mapping[str, ControlNetModel], sample: torch.Tensor, timesteps: torch.Tensor,
    inputs: Mapping[str, Any], uses: Sequence[ControlRows],
) -> Residuals | None:
    """The summed residuals of `uses` for a forward of `sample` ([B, C, h, w]) at `timesteps`
    ([B]); `inputs` are the ControlNets' other per-row inputs (`encoder_hidden_states`, and
    SDXL's `added_cond_kwargs` dict), each with B rows. None when nothing contributes."""
    active = active_uses(uses)
    if not active:
        return None
    per_use: list[Residuals | None] = [None] * len(active)
    for name, positions in by_controlnet(active).items():
        group = [active[p] for p in positions]
        for position, residuals in zip(positions, net_residuals(nets[name], sample, timesteps, inputs, group)):
            per_use[position] = residuals
    return sum_residuals(sample.shape[0], active, per_use)


def active_uses(uses: Sequence[ControlRows]) -> list[ControlRows]:
    """The uses that contribute at this step (scale 0: off by its start/end)."""
    return [use for use in uses if use.scale != 0.0]


def by_controlnet(active: Sequence[ControlRows]) -> dict[str, list[int]]:
    """Positions in `active` by ControlNet (one request may use a ControlNet twice, two images)."""
    out: dict[str, list[int]] = {}
    for position, use in enumerate(active):
        out.setdefault(use.name, []).append(position)
    return out


def net_residuals(net: ControlNetModel, sample: torch.Tensor, timesteps: torch.Tensor, inputs: Mapping[str, Any],
                  group: Sequence[ControlRows]) -> list[Residuals]:
    """One ControlNet's forward over the rows of every use in `group` (all of it), and each use's
    residuals, scaled."""
    index = group_rows(group).to(sample.device)
    down, mid = net(
        sample[index], timesteps[index], controlnet_cond=torch.cat([use.image for use in group]),
        conditioning_scale=1.0, return_dict=False, **rows_of(inputs, index),
    )
    out, offset = [], 0
    for use in group:
        part = slice(offset, offset + use.rows.stop - use.rows.start)
        out.append(([d[part] * use.scale for d in down], mid[part] * use.scale))
        offset = part.stop
    return out


def sum_residuals(batch: int, active: Sequence[ControlRows], per_use: Sequence[Residuals]) -> Residuals:
    """Each request's residuals summed in its own order (`MultiControlNetModel`), at its rows of a
    `batch`-row forward; zeros at the rows of requests without any."""
    first_down, first_mid = per_use[0]
    total_down = [d.new_zeros((batch, *d.shape[1:])) for d in first_down]
    total_mid = first_mid.new_zeros((batch, *first_mid.shape[1:]))
    summed: dict[tuple[int, int], Residuals] = {}
    for use, (down, mid) in zip(active, per_use):
        key = (use.rows.start, use.rows.stop)
        if key in summed:
            prev_down, prev_mid = summed[key]
            down, mid = [p + d for p, d in zip(prev_down, down)], prev_mid + mid
        summed[key] = (down, mid)
    for (start, stop), (down, mid) in summed.items():
        for total, d in zip(total_down, down):
            total[start:stop] = d
        total_mid[start:stop] = mid
    return total_down, total_mid


def rows_of(inputs: Mapping[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """`inputs` with every tensor (also inside nested dicts) cut to the rows of `index`."""
    return {key: rows_of(value, index) if isinstance(value, Mapping) else value[index]
            for key, value in inputs.items()}


def inputs_to(inputs: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    """`inputs` with every tensor (also inside nested dicts) on `device`."""
    return {key: inputs_to(value, device) if isinstance(value, Mapping) else value.to(device)
            for key, value in inputs.items()}


def group_rows(group: Sequence[ControlRows]) -> torch.Tensor:
    """The rows of a ControlNet's forward over `group`: each use's rows, in order."""
    return torch.cat([torch.arange(use.rows.start, use.rows.stop) for use in group])


class ControlNetService(Protocol):
    """ControlNets that run outside the worker (`deployments.controlnet_service`), in parallel
    with its UNet: `start` sends one ControlNet's forward over its rows and returns what waits for
    its uses' residuals (`net_residuals`'s, on the caller's device)."""

    def start(self, model: str, name: str, sample: torch.Tensor, timesteps: torch.Tensor,
              inputs: Mapping[str, Any], group: Sequence[ControlRows]) -> Callable[[], list[Residuals]]: ...


@dataclass(frozen=True)
class RemoteControlNets:
    """Where a family's ControlNets run when not on its worker (given when the family is built).
    Whether a step may add its request's previous step's residuals is its worker's add-on mode
    (`engine.addon_modes.stale_controlnet`)."""

    service: ControlNetService


def control_pixels(image: PIL.Image.Image, height: int, width: int) -> np.ndarray:
    """The first half of the ControlNet pipelines' `prepare_image` (`VaeImageProcessor.preprocess`
    of a PIL image, as they configure it): resized to the output size, then RGB. uint8 [height,
    width, 3]: a quarter of the float image's bytes, to carry from the ingress to a worker."""
    processor = _processor()
    return np.array(processor.convert_to_rgb(processor.resize(image, height, width)))


def control_tensor(pixels: np.ndarray) -> torch.Tensor:
    """The second half: float32 [1, 3, H, W] in [0, 1], as `pil_to_numpy` + `numpy_to_pt` make it."""
    return torch.from_numpy((pixels.astype(np.float32) / 255.0).transpose(2, 0, 1).copy()).unsqueeze(0)


def _processor() -> VaeImageProcessor:
    # As `StableDiffusion(XL)ControlNetPipeline.control_image_processor`; its scale factor only
    # matters when no size is given, and a size always is.
    return VaeImageProcessor(vae_scale_factor=8, do_convert_rgb=True, do_normalize=False)
