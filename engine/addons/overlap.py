"""ControlNet residuals that arrive while the UNet runs (SwiftDiffusion §4.1, Fig. 7-Right).

`UNet2DConditionModel.forward` adds ControlNet residuals to its skip connections right after its
down blocks and to its mid block's output, but the skip connections are read only by the up
blocks: so the residuals are needed only once the mid block is done. Forward hooks collect the
skip tensors as the down blocks make them, and the mid block's hook waits for the residuals and
adds them: to each skip tensor in place (the same float addition the UNet's own `res + residual`
does) and to the mid block's output. The UNet's encoder half thus runs while the ControlNets
run elsewhere, and the result is the UNet's with the residuals passed as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from stepserve.engine.addons.controlnet import Residuals


@contextmanager
def late_residuals(unet: nn.Module, wait: Callable[[], Residuals | None]) -> Iterator[None]:
    """While open, each forward of `unet` adds the residuals `wait()` returns (once its mid block
    has run; None: nothing to add)."""
    skips: list[torch.Tensor] = []

    def collect_conv_in(module, args, output):
        skips.clear()
        skips.append(output)

    def collect_down(module, args, output):
        skips.extend(output[1])

    def add_residuals(module, args, output):
        residuals = wait()
        if residuals is None:
            return output
        down, mid = residuals
        if len(down) != len(skips) or len({t.data_ptr() for t in skips}) != len(skips):
            raise RuntimeError(f"{len(down)} ControlNet residuals for {len(skips)} skip connections")
        for skip, residual in zip(skips, down):
            skip.add_(residual)
        return output + mid

    handles = [unet.conv_in.register_forward_hook(collect_conv_in),
               *(block.register_forward_hook(collect_down) for block in unet.down_blocks),
               unet.mid_block.register_forward_hook(add_residuals)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        skips.clear()
