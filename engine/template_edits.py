"""Edits of templates with cached activations, on the worker (InstGenIE §3.1, §4.2).

Services edit the same templates again and again with small masks. The first edit of a template
(model, image size, timesteps and rows alike) runs the exact forward and records each block's
image-token outputs at every step; later edits of it compute only their masked tokens in each
block and take the other tokens' outputs from that record (`engine.editing.masked_sd3`). This is
an approximation (the unmasked tokens' activations are the first edit's, not their own): a switch,
off by default (`edit_cache.enabled`), its fidelity measured against the exact path.

A request's `TemplateEdit` is its state in the template-edit forward mode
(`engine.forward_modes.template_edit`, which gives it one at admission); records go to the node's
activation store when the recording request finishes, and come back from it for later edits (`ActivationSource`: `actors.activation_store` on a worker, `ActivationCache` in
tests). What a record holds is the `CacheKind`: each block's outputs (the paper's main design:
keys and values are recomputed over every token) or each block's keys and values (its Fig. 7
alternative: twice the bytes, nothing but the masked tokens computed). A forward's record is
loaded slot by slot beside the computation (`BlockLoader`: pinned copies on a side CUDA stream), the
slots the worker's loading DP picks for that forward (`engine.editing.loading_plan`: the others'
blocks compute every token), counted in a `BlockTally`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from stepserve.engine.editing.block_loader import BlockLoader
from stepserve.engine.editing.loading_plan import BlockTally, LoadingPlanner
from stepserve.engine.editing.masked_sd3 import CacheKind, MaskedPlan
from stepserve.policies.types import RequestSpec

# "<step>.<slot>" -> one slot of one step's record, rows first (`engine.editing.masked_sd3`:
# per block, the image tokens' outputs or their keys and values).
Activations = dict[str, torch.Tensor]


class ActivationSource(Protocol):
    """Where a worker finds and keeps templates' activations."""

    def get(self, key: str) -> Activations | None: ...

    def put(self, key: str, activations: Activations) -> None: ...


@dataclass(frozen=True)
class TemplateCache:
    """A worker's templates: where their records are, what a record holds, and how a masked
    forward chooses the slots it loads (`edit_cache.loading`)."""

    source: ActivationSource
    kind: CacheKind = CacheKind.KEYS_VALUES
    planner: LoadingPlanner = LoadingPlanner()


def template_key(spec: RequestSpec, kind: CacheKind) -> str:
    """What an edit's cached activations must match: the model, the template, the latent grid,
    the timesteps it runs (steps and skipped steps), its rows (CFG or not) and the record's kind."""
    return (f"{spec.model}/{spec.template_id}/{spec.width}x{spec.height}/"
            f"{spec.num_inference_steps}-{spec.skip_steps}/{spec.rows}/{CacheKind(kind).value}")


@dataclass
class TemplateEdit:
    """One edit's use of its template: its masked tokens, and either the template's activations
    (`cached`, host memory) or what it records for the template meanwhile (`recorded`)."""

    key: str
    kind: CacheKind
    index: torch.Tensor  # [rows, M]: its masked image tokens (`token_index`)
    cached: Activations | None = None
    recorded: Activations = field(default_factory=dict)

    @property
    def records(self) -> bool:
        return self.cached is None


@dataclass(frozen=True)
class EditMember:
    """What `template_forward` reads of one member: its use of its template, its rows and the
    step it is at."""

    template: TemplateEdit
    rows: int
    step_index: int = 0


def template_forward(family: Any, samplers: Sequence[EditMember], sample: torch.Tensor, timesteps: torch.Tensor,
                     cond: dict[str, torch.Tensor], planner: LoadingPlanner = LoadingPlanner(),
                     tally: BlockTally | None = None) -> torch.Tensor:
    """One forward of a group of template edits: masked when every member has its template's
    activations (the slots `planner` picks loaded, counted in `tally`), else exact, recording the
    block outputs of the members that record."""
    kind = samplers[0].template.kind
    if all(not s.template.records for s in samplers):
        plan, planned = _plan(family, samplers, sample, kind, planner)
        if tally is not None:
            tally.count(tuple(plan.use_cache), planned)
        return family.denoise_masked(sample, timesteps, cond, plan)
    noise_pred, slots = family.denoise_recording(sample, timesteps, cond, kind)
    first = 0
    for sampler in samplers:
        rows = slice(first, first + sampler.rows)
        first += sampler.rows
        if sampler.template.records:
            for slot, tensor in enumerate(slots):
                sampler.template.recorded[f"{sampler.step_index}.{slot}"] = tensor[rows].to("cpu", copy=True)
    return noise_pred


def _plan(family: Any, samplers: Sequence[EditMember], sample: torch.Tensor, kind: CacheKind,
          planner: LoadingPlanner) -> tuple[MaskedPlan, bool]:
    """The members' masked tokens, padded to the longest (each row repeats its own first token:
    duplicate queries give identical outputs), and their records at their steps, the slots the
    planner picks for this forward's shape and mask ratio (the padded share: the forward computes
    that many tokens per row) loaded beside the computation; and whether measured costs picked
    them. (On an H100, sd3-medium at 1024 px, the DP loads all 24 blocks at 10-20% of the tokens and
    23 at 50%: docs/results/cache-loading-h100.)"""
    masked = max(s.template.index.shape[1] for s in samplers)
    index = torch.cat([_pad(s.template.index, masked) for s in samplers]).to(sample.device)
    rows, _, height, width = sample.shape
    patch, scale = family.patch_size, family.vae_scale_factor
    use_cache, planned = planner.use_cache(kind, family.cache_slots(kind), family.source.name, height * scale,
                                           width * scale, rows, masked / ((height // patch) * (width // patch)))
    loader = BlockLoader(lambda slot: [s.template.cached[f"{s.step_index}.{slot}"] for s in samplers], use_cache,
                         sample.device)
    return MaskedPlan(index, loader, use_cache, kind), planned


def _pad(index: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - index.shape[1]
    return index if not extra else torch.cat([index, index[:, :1].expand(-1, extra)], dim=1)
