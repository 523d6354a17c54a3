"""Add-ons to a denoiser forward: ControlNet residuals and LoRA updates, by the rows that use them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from stepserve.engine.addons.controlnet import ControlRows
from stepserve.engine.addons.lora import LoraRows


@dataclass(frozen=True)
class StepAddons:
    """What one forward adds to its denoiser: each request's ControlNets and LoRAs at this step."""

    controls: tuple[ControlRows, ...] = ()
    loras: tuple[LoraRows, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.controls or self.loras)

    def take(self, rows: slice) -> "StepAddons":
        """The add-ons of the forward's rows `rows` alone, counted from 0: what a worker that
        runs only those rows applies (a CFG split). Its ControlNets are exact, never stale: a
        stale holder keeps the residuals of all the request's rows, and a split request may go
        back to one worker (which then needs both rows') at any step."""
        controls = []
        for use in self.controls:
            cut = _overlap(use.rows, rows)
            if cut is not None:
                mine, theirs = cut
                controls.append(replace(use, rows=mine, image=use.image[theirs], stale=None))
        loras = [replace(use, rows=cut[0]) for use in self.loras if (cut := _overlap(use.rows, rows)) is not None]
        return StepAddons(tuple(controls), tuple(loras))


def _overlap(use: slice, rows: slice) -> tuple[slice, slice] | None:
    """Where a use's rows and `rows` overlap: counted from `rows.start`, and from `use.start`."""
    start, stop = max(use.start, rows.start), min(use.stop, rows.stop)
    if start >= stop:
        return None
    return slice(start - rows.start, stop - rows.start), slice(start - use.start, stop - use.start)


__all__ = ["ControlRows", "LoraRows", "StepAddons"]
