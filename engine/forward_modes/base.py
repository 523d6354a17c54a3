"""What every forward mode is: how it takes a group, runs its forward, and keeps per-request state.

A forward mode is one way to compute a group's noise prediction (diffusers' cache hooks and
SGLang's `DiffusionCache` are the models): the plain batched forward, a CFG split over two
ranks, one forward over several resolutions, a template edit's masked forward, the patch cache,
step caching.
A mode says which families serve it (a family names the modes it has beyond the plain forward
and the CFG split in `DiffusionFamily.forward_modes`), gives an admitted request its own state
for it (`admit`), takes a group or leaves it to the next mode (`takes`), refuses a group it took
but cannot run (`check`), and computes each member's prediction (`forward`). A request keeps at
most one mode's state (`Sampler.mode_state`); when a step of it runs in another mode's forward,
its mode hears of it (`missed`), and when it has advanced, too (`stepped`).

A new approximation is a new mode: its file here, its name below, its place in
`registry.forward_modes`, its switch (a field of `engine.mode_settings.ModeSettings`, or the
request's own field), and the families that declare it. What a request adds to a forward (its
ControlNets, its LoRAs) is the add-on modes' (`engine.addon_modes`), which compose with these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from stepserve.engine.addons import StepAddons
from stepserve.policies.types import StepGroup

if TYPE_CHECKING:
    from stepserve.engine.families.base import DiffusionFamily
    from stepserve.engine.sampler import Sampler


class ModeName(str, Enum):
    PLAIN = "plain"  # one batched forward, add-ons and sequence parallelism included
    CFG_SPLIT = "cfg_split"  # SwiftDiffusion: a lone request's two CFG rows on two ranks
    PACKED = "packed"  # PatchedServe §4: members of different resolutions in one forward
    TEMPLATE_EDIT = "template_edit"  # InstGenIE: edits of a template reuse its cached activations
    PATCH_CACHE = "patch_cache"  # PatchedServe §5: a request reuses its patches across steps
    STEP_CACHE = "step_cache"  # First-Block Cache: a request reuses its last step's later blocks
    SKIP_CFG = "skip_cfg"  # SynerDiff §III-B: a request's late steps run without its unconditional row


@dataclass(frozen=True)
class ForwardBatch:
    """One group's forward, ready to run: its members' samplers and model inputs (sample,
    timesteps, conditioning) in order, its family, the process group of its ranks (None: this
    worker alone) and its add-ons (each member's at its rows of the concatenated batch)."""

    group: StepGroup
    family: DiffusionFamily
    samplers: tuple[Sampler, ...]
    inputs: tuple[tuple, ...]
    process_group: Any
    addons: StepAddons

    @property
    def mixes_sizes(self) -> bool:
        """Its members' latents differ in shape (images of different resolutions)."""
        return len({sampler.latents.shape for sampler in self.samplers}) > 1

    def joined(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The members' inputs concatenated along rows (they share one latent size)."""
        if len(self.inputs) == 1:
            return self.inputs[0]
        sample, timesteps = (torch.cat([x[i] for x in self.inputs]) for i in (0, 1))
        return sample, timesteps, {name: torch.cat([x[2][name] for x in self.inputs]) for name in self.inputs[0][2]}

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """A concatenated prediction, cut back into each member's rows."""
        return list(rows.split([sampler.rows for sampler in self.samplers]))

    def all_in(self, mode: ModeName) -> bool:
        """Every member holds `mode`'s state."""
        return all(sampler.mode is mode for sampler in self.samplers)


class ForwardMode(ABC):
    name: ClassVar[ModeName]

    def serves(self, family: DiffusionFamily) -> bool:
        """The family has this mode."""
        return self.name in family.forward_modes

    def admit(self, sampler: Sampler, family: DiffusionFamily) -> None:
        """Give a request admitted on a family that serves this mode, and holding no mode's
        state yet, its state for this mode (`sampler.enter`) if it is to have one; fresh starts
        and resumes alike (the state is never exported)."""

    @abstractmethod
    def takes(self, batch: ForwardBatch) -> bool:
        """This mode runs the batch's forward (the runner asks its modes in order)."""

    def check(self, batch: ForwardBatch) -> None:
        """Raise ValueError if the batch it takes cannot run (its members then fail, refused)."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        """Each member's noise prediction, in order."""

    def missed(self, sampler: Sampler) -> None:
        """A request holding this mode's state took a step in another mode's forward."""

    def stepped(self, sampler: Sampler) -> None:
        """A request holding this mode's state advanced one step."""
