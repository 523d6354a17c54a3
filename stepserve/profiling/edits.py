"""`stepserve profile`'s masked rows (InstGenIE §4.4, Fig. 11): for a model whose family edits
with cached activations (the template-edit forward mode), the forward its workers serve for a batch of edits of
templates whose records they hold: denoise rows with mask_ratio < 1.

Per size of the denoise grid and number of edits (`ProfileGrid.masked_batches`, CFG's two rows
each where the model guides by CFG), the batch first records its own activations as a template's
first edit does (`template_forward` with no record: the exact forward, recording), so the
forwards timed after it are the real masked ones: `template_forward` over the members' records,
each slot loaded beside the computation from host memory (pinned on CUDA, as a worker pins a
record it fetched), loads included. The grid's mask ratios are timed round-robin after a warm-up.
A mask of ratio m covers the first round(m L) of the L image tokens (at least one), and the row
records that share. The records are of the config's cache kind (`edit_cache.cache`), which the
rows' source names: a profile prices the kind it was measured with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from stepserve.engine.editing.block_loader import pin
from stepserve.engine.editing.masked_sd3 import CacheKind, token_index
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.template_edits import EditMember, TemplateEdit, template_forward
from stepserve.engine.text_encoding import embed
from stepserve.policies.cost_model import DENOISE, ProfileRow
from stepserve.policies.instgenie.edit_profile import fitted_edit_models
from stepserve.profiling.common import PROMPT, Context, first_timestep, forward_inputs, interleaved_medians, log

PROFILE_KEY = "profile"  # the records never leave this process: any key will do


def masked_forwards(ctx: Context, header: str, threads: int) -> Iterator[tuple[int, int, int, tuple]]:
    """Every masked forward of the grid, after logging `header` and the grid: (size, edits, rows per
    edit, the forward's sample, timesteps and conditioning for all the edits' rows); none where the
    family has no cached edits or the grid no mask ratios. One prompt, timestep and noise seed."""
    family, grid = ctx.family, ctx.grid
    if ModeName.TEMPLATE_EDIT not in family.forward_modes or not grid.mask_ratios:
        return
    per_edit = 2 if family.classifier_free_guidance else 1
    log(f"{header}, sizes {list(grid.sizes)}, edits {list(grid.masked_batches)} of {per_edit} row(s), mask ratios "
        f"{list(grid.mask_ratios)}, {threads} thread(s)")
    text = embed(family, PROMPT)
    t = first_timestep(family)
    generator = torch.Generator("cpu").manual_seed(0)
    for size in grid.sizes:
        for edits in grid.masked_batches:
            yield size, edits, per_edit, forward_inputs(family, text, t, edits * per_edit, size, generator)


def measure_masked(ctx: Context, kind: CacheKind, threads: int) -> list[ProfileRow]:
    """The masked rows of `ctx`'s model, or none where its family has no cached edits or the grid
    no mask ratios."""
    family, grid = ctx.family, ctx.grid
    kind = CacheKind(kind)
    out = []
    for size, edits, per_edit, inputs in masked_forwards(ctx, f"[denoise, masked] {kind.value} records", threads):
        rows = edits * per_edit
        sample, timesteps, cond = inputs
        records = self_records(family, kind, size, inputs, edits, per_edit)
        cases, counts = {}, {}
        for ratio in grid.mask_ratios:
            index, tokens = masked_tokens(family, size, per_edit, ratio)
            share = index.shape[1] / tokens
            counts[share] = f"{index.shape[1]} of {tokens} tokens"
            members = [EditMember(TemplateEdit(PROFILE_KEY, kind, index, record), per_edit)
                       for record in records]
            cases[share] = (lambda m=members: template_forward(family, m, sample, timesteps, cond))
        medians = interleaved_medians(cases, ctx.watch, grid.warmup, grid.repeats,
                                      lambda m: f"{size}px rows {rows} mask {m:.3g}")
        out += [ctx.row(DENOISE, seconds, grid.repeats, size, size, rows,
                        f"template_forward over cached {kind.value} ({counts[share]}), loads included, {edits} "
                        f"edit(s) of {per_edit} row(s), {threads} thread(s)", mask_ratio=share)
                for share, seconds in medians.items()]
    return out


def masked_tokens(family, size: int, rows: int, ratio: float) -> tuple[torch.Tensor, int]:
    """The masked image tokens of `rows` rows at `size` px (`token_index`: the first
    round(ratio x tokens) of them, at least one) and how many tokens a row has."""
    patch = family.patch_size
    side = size // family.vae_scale_factor // patch
    tokens = side * side
    flat = torch.zeros(tokens)
    flat[: max(1, round(ratio * tokens))] = 1
    latent = flat.reshape(side, side).repeat_interleave(patch, 0).repeat_interleave(patch, 1)
    return token_index(latent.expand(rows, 1, -1, -1), patch).to(family.device), tokens


def self_records(family, kind: CacheKind, size: int, inputs: tuple, edits: int,
                 per_edit: int) -> list[dict[str, torch.Tensor]]:
    """Each edit's record of the forward of `inputs` (sample, timesteps, conditioning), in host
    memory as a worker holds a record it fetched."""
    index, _ = masked_tokens(family, size, per_edit, 1.0)  # unread: a recording forward computes every token
    members = [EditMember(TemplateEdit(PROFILE_KEY, kind, index), per_edit) for _ in range(edits)]
    template_forward(family, members, *inputs)
    return [pin(m.template.recorded) if family.device.type == "cuda" else m.template.recorded for m in members]


def masked_fit_report(ctx: Context, kind: CacheKind, rows: Sequence[ProfileRow]) -> str:
    """How well the edit pricing fitted to the masked rows (FLOPs to seconds, the paper's Fig. 11)
    meets them: the line's R^2 and the relative error at each measured point."""
    dims = type(ctx.family).dit_dims(ctx.family.source, kind)
    edit = fitted_edit_models(rows, {ctx.model: dims})[ctx.model]
    errors = [abs(edit.seconds(r.height, r.width, r.rows, r.mask_ratio) - r.seconds) / r.seconds for r in rows]
    return (f"  denoise (masked)     FLOPs line {len(rows):>3} pts  R^2 {edit.compute.r2:.3f}, rel. error at the "
            f"points mean {sum(errors) / len(errors):.1%}, max {max(errors):.1%}")
