"""Which forward modes a worker runs, in the order it tries them on a group (the first that takes
a group runs it) and gives admitted requests their state (the first that gives one wins: an
edit of a template records or reuses its template's activations rather than its own patches).
The packed, CFG-split and plain modes are always there: they are exact, and the router's plans
ask for them; so are step caching and skip-CFG, which come with the request (`RequestSpec.step_cache`,
`skip_cfg_from`: the ingress sets them from the request and its model's config); the other
approximations are there only when switched on. Skip-CFG comes after step caching: a request
that asks for both holds the step cache, whose forward skips its unconditional rows too."""

from __future__ import annotations

from stepserve.engine.forward_modes.base import ForwardMode, ModeName
from stepserve.engine.forward_modes.cfg_split import CfgSplit
from stepserve.engine.forward_modes.packed import PackedResolutions
from stepserve.engine.forward_modes.patch_cache import PatchCaching
from stepserve.engine.forward_modes.plain import Plain
from stepserve.engine.forward_modes.skip_cfg import CfgSkipping
from stepserve.engine.forward_modes.step_cache import StepCaching
from stepserve.engine.forward_modes.template_edit import TemplateEdits
from stepserve.engine.mode_settings import ModeSettings


def forward_modes(settings: ModeSettings = ModeSettings()) -> dict[ModeName, ForwardMode]:
    """A step runner's forward modes by name, in order, from its settings (`templates`,
    `patch_reuse`, `pack_resolutions`)."""
    modes: list[ForwardMode] = [PackedResolutions(join=settings.pack_resolutions), CfgSplit()]
    if settings.templates is not None:
        modes.append(TemplateEdits(settings.templates))
    if settings.patch_reuse:
        modes.append(PatchCaching(settings.patch_reuse))
    modes.append(StepCaching())
    modes.append(CfgSkipping())
    modes.append(Plain())
    return {mode.name: mode for mode in modes}
