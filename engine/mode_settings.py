"""The settings of a step runner's modes, forward and add-on, as one frozen value made once: a
worker's from its pool's options (`actors.denoiser.mode_settings`), a benchmark's or a test's
from what it measures. Every default is exact."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepserve.engine.addons.lora import LoraLoader
from stepserve.engine.addons.source import LoraJoinBounds
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse
from stepserve.engine.template_edits import TemplateCache


@dataclass(frozen=True)
class ModeSettings:
    """`templates`: where edits of templates find and keep cached activations (None: every edit
    is exact); `patch_reuse`: by model, how its requests reuse their patches (a model not named:
    never); `pack_resolutions`: a plan's plain groups of one model run as one forward;
    `loras`: brings LoRAs that are not in the families yet (None: every LoRA a request names
    must be loaded already); `lora_bounds`: the fraction of a request's steps that may run
    before each of its LoRAs has arrived (0: none, exact); `stale_controlnets`: ControlNets the
    service runs may be one step stale."""

    templates: TemplateCache | None = None
    patch_reuse: Mapping[str, PatchReuse] = field(default_factory=dict)
    pack_resolutions: bool = False
    loras: LoraLoader | None = None
    lora_bounds: LoraJoinBounds = LoraJoinBounds()
    stale_controlnets: bool = False
