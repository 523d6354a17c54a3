"""What every add-on mode is: how a request's add-ons reach the forward that runs its step, and
the state it keeps per request.

A forward mode (`engine.forward_modes`) decides how a group's forward runs; one forward runs a
request's step, so a request holds one forward mode's state at most. An add-on mode decides what
a member adds to that forward, whichever forward it is: its ControlNets' residuals one step old,
its LoRAs joined late. Those compose with every forward mode (a step-cached or skip-CFG request
may use a stale ControlNet), so a request holds the state of every add-on mode that gives it one
(`Sampler.addon_state`, by mode).

A mode says which families serve it (`serves`), gives an admitted request its state (`admit`:
fresh starts and resumes alike; the state is never exported), makes ready what a member's step
needs before the forward gathers its inputs (`prepare`, after `begin_forward` once per forward),
and changes the add-ons the member brings (`adjust`). What it raises fails that request alone.

A new way to bring add-ons is a new mode: its file here, its name below, its place in
`registry.addon_modes`, and its field of `engine.mode_settings.ModeSettings`.
"""

from __future__ import annotations

from abc import ABC
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

from stepserve.engine.addons import StepAddons

if TYPE_CHECKING:
    from stepserve.engine.families.base import DiffusionFamily
    from stepserve.engine.sampler import Sampler


class AddonModeName(str, Enum):
    LORA_JOINING = "lora_joining"  # SwiftDiffusion §4.2: LoRAs load beside the steps; late joins within a bound
    STALE_CONTROLNET = "stale_controlnet"  # SwiftDiffusion §4.1: a step adds the previous step's residuals


class AddonMode(ABC):
    name: ClassVar[AddonModeName]

    def serves(self, family: DiffusionFamily) -> bool:
        """The family takes add-ons this mode brings."""
        return family.takes_addons

    def admit(self, sampler: Sampler, family: DiffusionFamily) -> None:
        """Give a request admitted on a family this mode serves its state, if it is to have one
        (`sampler.addon_state[self.name]`); raise if it cannot be served here."""

    def begin_forward(self) -> None:
        """A forward's members are about to be prepared."""

    def prepare(self, sampler: Sampler, family: DiffusionFamily) -> None:
        """Make ready what the request's next step needs (it then gathers its add-ons)."""

    def adjust(self, sampler: Sampler, addons: StepAddons) -> StepAddons:
        """The add-ons the request brings to this forward, from the exact ones (`Sampler.addons`)."""
        return addons
