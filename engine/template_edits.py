"""Edits of templates with cached activations, on the worker (InstGenIE §3.1, §4.2).

Services edit the same templates again and again with small masks. The first edit of a template
(model, image size, timesteps and rows alike) runs the exact forward and records each block's
image-token outputs at every step; later edits of it compute only their masked tokens in each
block and take the other tokens' outputs from that record (`engine.editing.masked_sd3`). This is
an approximation (the unmasked tokens' activations are the first edit's, not their own): a switch,
off by default (`edit_cache.enabled`), its fidelity measured against the exact path.

A request's `TemplateEdit` rides on its `Sampler` (the runner attaches it at admission); records
go to the node's activation store when the recording request finishes, and come back from it for
later edits (`ActivationSource`: `actors.activation_store` on a worker, any mapping in tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from stepserve.engine.editing.masked_sd3 import MaskedPlan, token_index
from stepserve.policies.types import RequestSpec

Activations = dict[str, torch.Tensor]  # "<step>.<block>" -> image-token outputs [rows, tokens, hidden]


class ActivationSource(Protocol):
    """Where a worker finds and keeps templates' activations."""

    def get(self, key: str) -> Activations | None: ...

    def put(self, key: str, activations: Activations) -> None: ...


def template_key(spec: RequestSpec) -> str:
    """What an edit's cached activations must match: the model, the template, the latent grid,
    the timesteps it runs (steps and skipped steps) and its rows (CFG or not)."""
    return (f"{spec.model}/{spec.template_id}/{spec.width}x{spec.height}/"
            f"{spec.num_inference_steps}-{spec.skip_steps}/{spec.rows}")


@dataclass
class TemplateEdit:
    """One edit's use of its template: its masked tokens, and either the template's activations
    (`cached`, host memory) or what it records for the template meanwhile (`recorded`)."""

    key: str
    index: torch.Tensor  # [rows, M]: its masked image tokens (`token_index`)
    cached: Activations | None = None
    recorded: Activations = field(default_factory=dict)

    @property
    def records(self) -> bool:
        return self.cached is None


def attach(sampler: Any, family: Any, source: ActivationSource) -> None:
    """Give an admitted edit of a template its `TemplateEdit` (the template's activations if the
    store has them, else it records them)."""
    spec = sampler.spec
    key = template_key(spec)
    mask = sampler.edit.mask.expand(spec.rows, -1, -1, -1)
    sampler.template = TemplateEdit(key, token_index(mask, family.patch_size), source.get(key))


def template_forward(family: Any, samplers: list[Any], sample: torch.Tensor, timesteps: torch.Tensor,
                     cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward of a group of template edits: masked when every member has its template's
    activations, else exact, recording the block outputs of the members that record."""
    templates = [s.template for s in samplers]
    if all(not t.records for t in templates):
        return family.denoise_masked(sample, timesteps, cond, _plan(family, samplers, sample.device))
    noise_pred, blocks = family.denoise_recording(sample, timesteps, cond)
    first = 0
    for sampler in samplers:
        rows = slice(first, first + sampler.rows)
        first += sampler.rows
        if sampler.template.records:
            for b, output in enumerate(blocks):
                sampler.template.recorded[f"{sampler.step_index}.{b}"] = output[rows].to("cpu", copy=True)
    return noise_pred


def finished_record(sampler: Any) -> Activations | None:
    """A finished recording edit's whole record (every step, every block), else None."""
    template = getattr(sampler, "template", None)
    if template is None or not template.records or not sampler.done:
        return None
    return template.recorded


def _plan(family: Any, samplers: list[Any], device: torch.device) -> MaskedPlan:
    """The members' masked tokens, padded to the longest (each row repeats its own first token:
    duplicate queries give identical outputs), and their cached block outputs at their steps."""
    width = max(s.template.index.shape[1] for s in samplers)
    index = torch.cat([_pad(s.template.index, width) for s in samplers]).to(device)

    def cached(block: int) -> torch.Tensor:
        parts = [s.template.cached[f"{s.step_index}.{block}"] for s in samplers]
        return torch.cat(parts).to(device=device, non_blocking=True)

    return MaskedPlan(index, cached, [True] * family.blocks)


def _pad(index: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - index.shape[1]
    return index if not extra else torch.cat([index, index[:, :1].expand(-1, extra)], dim=1)
