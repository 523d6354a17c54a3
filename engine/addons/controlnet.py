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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import ControlNetModel
from diffusers.image_processor import VaeImageProcessor

# Residuals for the UNet: one tensor per skip connection of its down blocks, and the mid block's.
Residuals = tuple[list[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ControlRows:
    """One request's use of one ControlNet in a forward."""

    name: str
    rows: slice  # the request's rows of the forward's batch
    image: torch.Tensor  # [rows, 3, H, W] in [0, 1]: one copy per row, as the pipelines repeat it under CFG
    scale: float  # conditioning scale at this step (0 outside its start/end: it contributes nothing)


def control_residuals(
    nets: Mapping[str, ControlNetModel], sample: torch.Tensor, timesteps: torch.Tensor,
    inputs: Mapping[str, Any], uses: Sequence[ControlRows],
) -> Residuals | None:
    """The summed residuals of `uses` for a forward of `sample` ([B, C, h, w]) at `timesteps`
    ([B]); `inputs` are the ControlNets' other per-row inputs (`encoder_hidden_states`, and
    SDXL's `added_cond_kwargs` dict), each with B rows. None when nothing contributes."""
    active = [use for use in uses if use.scale != 0.0]
    if not active:
        return None
    by_net: dict[str, list[int]] = {}  # positions in `active`: one request may use a ControlNet twice
    for position, use in enumerate(active):
        by_net.setdefault(use.name, []).append(position)
    scaled: dict[int, Residuals] = {}
    for name, positions in by_net.items():
        group = [active[p] for p in positions]
        index = torch.cat([torch.arange(use.rows.start, use.rows.stop) for use in group]).to(sample.device)
        down, mid = nets[name](
            sample[index], timesteps[index], controlnet_cond=torch.cat([use.image for use in group]),
            conditioning_scale=1.0, return_dict=False, **_rows(inputs, index),
        )
        offset = 0
        for position, use in zip(positions, group):
            part = slice(offset, offset + use.rows.stop - use.rows.start)
            scaled[position] = ([d[part] * use.scale for d in down], mid[part] * use.scale)
            offset = part.stop
    # Per request (rows), its residuals summed in its own order.
    total_down = [torch.zeros((sample.shape[0], *d.shape[1:]), dtype=d.dtype, device=d.device)
                  for d in scaled[0][0]]
    first_mid = scaled[0][1]
    total_mid = torch.zeros((sample.shape[0], *first_mid.shape[1:]), dtype=first_mid.dtype, device=first_mid.device)
    summed: dict[tuple[int, int], Residuals] = {}
    for position, use in enumerate(active):
        key = (use.rows.start, use.rows.stop)
        down, mid = scaled[position]
        if key in summed:
            prev_down, prev_mid = summed[key]
            down, mid = [p + d for p, d in zip(prev_down, down)], prev_mid + mid
        summed[key] = (down, mid)
    for (start, stop), (down, mid) in summed.items():
        for total, d in zip(total_down, down):
            total[start:stop] = d
        total_mid[start:stop] = mid
    return total_down, total_mid


def _rows(inputs: Mapping[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """`inputs` with every tensor (also inside nested dicts) cut to the rows of `index`."""
    return {key: _rows(value, index) if isinstance(value, Mapping) else value[index]
            for key, value in inputs.items()}


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
