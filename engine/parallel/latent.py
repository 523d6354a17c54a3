"""Latent parallelism (SwiftDiffusion §4.3): the two rows of a classifier-free-guidance request,
unconditional and conditional, denoised on two workers at once.

Both workers hold the whole request (same latents, same scheduler, same generator: they were
admitted from the same conditioning) and call this with the same full inputs. Each runs the
denoiser on its own row, add-ons included, and one all-gather swaps the two noise predictions,
so both get the full [uncond, cond] output, guide and step exactly alike, and stay identical.
Rows are independent in a denoiser forward, so the result equals the unsplit forward up to
float rounding (a batch of one runs other GEMM shapes). What crosses between the workers is one
latent-sized tensor per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stepserve.engine.addons import StepAddons

RANKS = 2  # uncond, cond


def cfg_split_denoise(family: Any, sample: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                      group: Any, addons: StepAddons | None = None) -> torch.Tensor:
    """`family.denoise` of one CFG request's two rows, this rank computing row `rank` of `group`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != RANKS or sample.shape[0] != RANKS:
        raise ValueError(f"a CFG split runs one request's {RANKS} rows on {RANKS} ranks, "
                         f"got {sample.shape[0]} rows on {size}")
    mine = slice(rank, rank + 1)
    extra = {"addons": addons.take(mine)} if addons else {}
    out = family.denoise(sample[mine], timesteps[mine], {name: value[mine] for name, value in cond.items()},
                         **extra).contiguous()
    parts = [torch.empty_like(out) for _ in range(RANKS)]
    dist.all_gather(parts, out, group=group)
    return torch.cat(parts)
