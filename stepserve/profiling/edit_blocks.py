"""`stepserve profile`'s block rows (InstGenIE §4.2, Algorithm 1): for a model whose family edits
with cached activations, each cache slot's costs in a masked forward over a record of block
outputs, the numbers the workers' loading DP plans with (`engine.editing.loading_plan`).

Per size of the denoise grid and number of edits (`ProfileGrid.masked_batches`, CFG's two rows
each where the model guides by CFG), the forward first records its own block outputs (the exact
forward, recording), held in host memory as a worker holds a record it fetched (pinned on CUDA).
Then every block is timed alone on its input from a plain forward (`engine.editing.block_costs`):
`block_full` (C_wo, every token), `block_load` (L, its slot copied to the device: 0 on CPU, where
the computation reads the host copy itself) once, from the first mask ratio's measurement (neither
depends on the mask), and `block_cached` (C_w, the masked tokens, the rest from the slot) at each of
the grid's mask ratios (a mask of ratio m covers the first round(m L) tokens, at least one; the row
records that share). Always of an `outputs` record, whatever the config's kind: only its blocks
may compute every token instead, so only its forwards are planned.
"""

from __future__ import annotations

from stepserve.engine.editing.block_loader import pin
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.policies.cost_model import BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD, ProfileRow
from stepserve.profiling.common import Context, log
from stepserve.profiling.edits import masked_forwards, masked_tokens


def measure_edit_blocks(ctx: Context, threads: int) -> list[ProfileRow]:
    """The block rows of `ctx`'s model, or none where its family has no cached edits or the grid
    no mask ratios."""
    family, grid = ctx.family, ctx.grid
    out = []
    for size, edits, per_edit, inputs in masked_forwards(ctx, "[block costs] outputs records", threads):
        rows = edits * per_edit
        _, slots = family.denoise_recording(*inputs, CacheKind.OUTPUTS)
        record = list(pin(dict(enumerate(s.cpu() for s in slots))).values()) if family.device.type == "cuda" \
            else slots
        note = f"{edits} edit(s) of {per_edit} row(s), outputs record, {threads} thread(s)"
        for k, ratio in enumerate(grid.mask_ratios):
            index, tokens = masked_tokens(family, size, rows, ratio)
            costs = family.block_costs(*inputs, index, record, CacheKind.OUTPUTS, grid.warmup, grid.repeats)
            share = index.shape[1] / tokens
            log(f"  {size}px rows {rows} mask {share:.3g}: C_w {_ms(costs.c_with)}, C_wo {_ms(costs.c_without)}, "
                f"L {_ms(costs.load)} ms")
            for slot, seconds in enumerate(costs.c_with):
                out.append(ctx.row(BLOCK_CACHED, seconds, grid.repeats, size, size, rows,
                                   f"block {slot} masked ({index.shape[1]} of {tokens} tokens), the rest cached, "
                                   f"{note}", mask_ratio=share, slot=slot))
            if k == 0:
                for component, what, values in ((BLOCK_FULL, "every token", costs.c_without),
                                                 (BLOCK_LOAD, "its cached outputs to the device", costs.load)):
                    out += [ctx.row(component, seconds, grid.repeats, size, size, rows,
                                    f"block {slot} {what}, {note}", slot=slot)
                            for slot, seconds in enumerate(values)]
    return out


def _ms(seconds: tuple[float, ...]) -> str:
    return "/".join(f"{s * 1e3:.3f}" for s in seconds)
