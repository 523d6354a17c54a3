"""What ControlNets and LoRAs add to one denoiser forward (SwiftDiffusion §4.1-§4.2), by where the
ControlNets run. Pure arithmetic over the profile's fitted times; `cost_model` asks it.

- INLINE: the denoiser runs each ControlNet call, then its UNet (diffusers' ControlNet pipelines;
  `controlnet_service.enabled: false`): their times add up.
- SERVICE: each call runs on a ControlNet service device of its own, all at once, while the UNet
  runs its encoder half (down and mid blocks); the decoder half waits for the residuals
  (`controlnet_service.enabled`, exact). The critical path is
  max(encoder, slowest call + its transfer) + decoder: Gustafson's ideal when transfers are free.
- STALE: as SERVICE, but the residuals are the previous step's, computed during it
  (`controlnet_service.stale`, approximate): the calls hide behind a whole forward.

The service is taken to have a device free for every call of a forward (size it with the
simulator's ControlNet busy time); LoRA updates run unmerged on the denoiser, batched across
requests, and stretch both UNet halves alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class ControlNetPlacement(str, Enum):
    INLINE = "inline"
    SERVICE = "service"
    STALE = "stale"


def forward_seconds(unet_s: float, encoder_s: float, calls: Sequence[tuple[float, float]], lora_s: float,
                    placement: ControlNetPlacement) -> float:
    """One forward: the UNet's `unet_s` (of which `encoder_s` comes before the decoder blocks),
    `lora_s` of unmerged LoRA updates, and ControlNet `calls` as (compute, transfer) seconds."""
    base = unet_s + lora_s
    if not calls:
        return base
    if placement is ControlNetPlacement.INLINE:
        return base + sum(compute for compute, _ in calls)
    beside = max(compute + transfer for compute, transfer in calls)
    if placement is ControlNetPlacement.STALE:
        return max(base, beside)
    encoder = min(encoder_s, unet_s) * (base / unet_s if unet_s > 0 else 1.0)
    return max(encoder, beside) + (base - encoder)


def ideal_seconds(unet_s: float, encoder_s: float, calls: Sequence[tuple[float, float]], lora_s: float) -> float:
    """SERVICE with free transfers: the critical path Gustafson's law bounds the speed-up by."""
    return forward_seconds(unet_s, encoder_s, [(compute, 0.0) for compute, _ in calls], lora_s,
                           ControlNetPlacement.SERVICE)
