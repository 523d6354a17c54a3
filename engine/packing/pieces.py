"""A packed forward's members grouped into pieces, one per latent shape, and its outputs handed
back member by member: what every family's `denoise_mixed` does around its packed forward.

Members of one latent shape go in as one piece (their rows share position ids, and their
attention runs as one batch); shapes of equal token counts (64x128 and 128x64) are two pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

# (sample, timesteps, cond), as a family's `denoise` takes them (cond: its `RowConditioning`).
Member = tuple[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]]


def denoise_by_shape(members: Sequence[Member],
                     forward: Callable[[list[Member]], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Each member's output, from one `forward` over the pieces: one (sample, timesteps, cond)
    per latent shape, its members' rows concatenated in order; `forward` gives each piece's
    output with its rows in the same order."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, (sample, _, _) in enumerate(members):
        by_shape.setdefault(tuple(sample.shape[1:]), []).append(i)
    pieces = []
    for indices in by_shape.values():
        parts = [members[i] for i in indices]
        pieces.append((torch.cat([sample for sample, _, _ in parts]), torch.cat([t for _, t, _ in parts]),
                       {name: torch.cat([cond[name] for _, _, cond in parts]) for name in parts[0][2]}))
    outputs: dict[int, torch.Tensor] = {}
    for indices, out in zip(by_shape.values(), forward(pieces)):
        outputs.update(zip(indices, out.split([members[i][0].shape[0] for i in indices])))
    return [outputs[i] for i in range(len(members))]
