"""An `SD3Transformer2DModel` forward that reuses each request's patches from its previous step
where the reuse predictor allows (PatchedServe §5.1, Fig. 10), and the exact forward that records
what the predictor learns from.

Before each block, every row's input is compared with its request's cached input of that block,
patch by patch (step 1 of Fig. 10); the predictor turns the changes into a reuse mask (step 2).
The block then computes the patches to recompute with InstGenIE's masked block
(`engine.editing.masked_block.masked_block_forward`: queries, attention output and feed-forward
of those tokens, keys and values of every token, so the recomputed tokens see this step's whole
image), and the reused patches' tokens take their cached outputs (steps 3-4). The recomputed
patches' inputs and outputs replace the cached ones (step 5, `engine.patch_cache.cache`). Text
tokens are computed in full in every block, as every later block attends to them.

A block in which no row recomputes anything still computes its text stream (over every image
token's keys and values) and, to keep the batch rectangular, one image token per row; the last
block, whose text stream ends, is then skipped outright. A row with nothing cached yet, or in its
first `full_steps` steps, recomputes every patch, and a block where every row does so runs the
plain diffusers block: a request's first step is the exact forward (`transformer(...)` bit for
bit), and so is every step of a predictor that never reuses.

The forward is the model's own, unrolled over diffusers' modules as `engine.editing.masked_sd3`
does. ControlNet residuals, IP-adapters and skipped layers are not part of this path; nor are
rows of different sizes in one forward (every row of a forward has one token grid).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.attention import JointTransformerBlock

from stepserve.engine.editing.masked_block import masked_block_forward
from stepserve.engine.editing.masked_sd3 import SD3Inputs, unrolled_forward
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.patches import PatchGrid
from stepserve.engine.patch_cache.predictor import ReusePredictor
from stepserve.engine.patch_cache.statistics import ReuseStatistics
from stepserve.kernels.masked_attention import gather_tokens, scatter_tokens

# SD3's flow-matching scheduler trains over 1000 timesteps: timestep / 1000 is the noise level.
TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class PatchReuse:
    """How a forward reuses patches: the predictor, the patch side in image tokens (SD3's tokens
    are 2 x 2 latents, 16 x 16 pixels: side 4 is a 64-pixel patch), and how many of a request's
    first steps compute every patch (at least the first: nothing is cached before it)."""

    predictor: ReusePredictor
    side: int = 4
    full_steps: int = 1

    def __post_init__(self) -> None:
        if self.side < 1 or self.full_steps < 1:
            raise ValueError(f"need a patch side and full steps >= 1, got {self.side} and {self.full_steps}")


@dataclass(frozen=True)
class _Forward:
    """What every block of one forward shares."""

    caches: Sequence[PatchCache]
    grid: PatchGrid
    noise_level: torch.Tensor  # [B]
    filled: tuple[bool, ...]  # per request: it had a previous step cached when this forward began

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,) if len(self.caches) == 1 else x.split([cache.rows for cache in self.caches])

    def row_mask(self, ready: Sequence[bool], device: torch.device) -> torch.Tensor:
        """Per request `ready`, per row: [B] bool."""
        return torch.tensor([ok for cache, ok in zip(self.caches, ready) for _ in range(cache.rows)], device=device)

    def cached(self, block: int, which: str, ready: Sequence[bool], fallback: torch.Tensor,
               caches: Sequence[PatchCache | None] | None = None) -> torch.Tensor:
        """The rows' cached `inputs` or `outputs` of `block` in `caches` (default: this forward's),
        [B, tokens, H]; a request that is not `ready` has `fallback`'s rows there (it recomputes
        them all, or records nothing)."""
        caches = self.caches if caches is None else caches
        parts = [getattr(cache, which)[block] if ok else rows
                 for cache, ok, rows in zip(caches, ready, self.split(fallback))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def store(self, block: int, inputs: torch.Tensor, outputs: torch.Tensor, reused: torch.Tensor | None) -> None:
        """Each request's rows of `block`'s inputs and outputs, and the patches it reused
        ([B, patches] bool; None: none). In a batch of several requests, each takes a copy of
        its rows: a slice would keep the whole batch's tensor alive for as long as any member
        keeps its entry (a paused request would hold its partners' rows)."""
        own = len(self.caches) > 1
        for cache, i, o in zip(self.caches, self.split(inputs), self.split(outputs)):
            i, o = (i.clone(), o.clone()) if own else (i, o)
            if len(cache.outputs) == block:  # its first forward through the cache
                cache.inputs.append(i)
                cache.outputs.append(o)
            else:
                cache.inputs[block], cache.outputs[block] = i, o
        if reused is not None:
            for cache, mine in zip(self.caches, self.split(reused)):
                cache.reused[block] += mine.sum()


# (block number, block, image tokens, text tokens, temb, the forward) -> (text tokens, image tokens)
_BlockRun = Callable[[int, JointTransformerBlock, torch.Tensor, torch.Tensor, torch.Tensor, _Forward],
                     tuple[torch.Tensor | None, torch.Tensor]]


def patch_cached_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, caches: Sequence[PatchCache],
                         reuse: PatchReuse) -> torch.Tensor:
    """The noise prediction [B, C, h, w] of rows belonging to `caches` in order (each request's
    `rows` consecutive rows), reusing their cached patches where `reuse.predictor` allows, and
    updating the caches."""
    if len(reuse.predictor.block_bias) != len(transformer.transformer_blocks):
        raise ValueError(f"the predictor knows {len(reuse.predictor.block_bias)} blocks, the transformer has "
                         f"{len(transformer.transformer_blocks)}")

    def run(b: int, block: JointTransformerBlock, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
            fwd: _Forward) -> tuple[torch.Tensor | None, torch.Tensor]:
        ready = [filled and cache.steps >= reuse.full_steps for cache, filled in zip(fwd.caches, fwd.filled)]
        if not any(ready):
            return _plain(b, block, x, context, temb, fwd)
        cached_in = fwd.cached(b, "inputs", ready, x)
        reused = reuse.predictor.reusable(b, fwd.noise_level, fwd.grid.relative_mse(x, cached_in))
        if not all(ready):
            reused &= fwd.row_mask(ready, reused.device)[:, None]
        if not bool(reused.any()):
            return _plain(b, block, x, context, temb, fwd)
        cached_out = fwd.cached(b, "outputs", ready, x)
        recompute = ~reused
        if block.context_pre_only and not bool(recompute.any()):
            context, out, new_in = None, cached_out, cached_in  # nothing computed, and no text to carry on
        else:
            index = fwd.grid.computed_tokens(recompute)
            context, out = masked_block_forward(block, x, context, temb, index, cached_out)
            new_in = scatter_tokens(cached_in, index, gather_tokens(x, index))
        fwd.store(b, new_in, out, reused)
        return context, out

    return _forward(transformer, inputs, caches, reuse.side, run)


def statistics_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, caches: Sequence[PatchCache],
                       previous: Sequence[Sequence[PatchCache]], side: int,
                       statistics: ReuseStatistics) -> torch.Tensor:
    """The exact noise prediction (every patch computed, by the plain blocks), storing this step
    in `caches` (fresh ones, one per request) and adding to `statistics`, for each request's
    caches of earlier steps (`previous[i]`, any number, any age), each block's input and output
    change per patch against them. Ages beyond one step stand for what a cached forward meets:
    a patch reused for a while is compared with an input several steps old."""
    def run(b: int, block: JointTransformerBlock, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
            fwd: _Forward) -> tuple[torch.Tensor | None, torch.Tensor]:
        context, out = _plain(b, block, x, context, temb, fwd)
        for age in range(max(len(earlier) for earlier in previous)):
            references = [earlier[age] if age < len(earlier) else None for earlier in previous]
            ready = [reference is not None for reference in references]
            rows = fwd.row_mask(ready, x.device)
            cached_in = fwd.cached(b, "inputs", ready, x, references)
            cached_out = fwd.cached(b, "outputs", ready, out, references)
            statistics.add(b, fwd.noise_level[rows], fwd.grid.relative_mse(x, cached_in)[rows],
                           fwd.grid.relative_mse(out, cached_out)[rows])
        return context, out

    if len(previous) != len(caches) or any(cache.filled for cache in caches):
        raise ValueError("need one fresh cache and one list of earlier caches per request")
    return _forward(transformer, inputs, caches, side, run)


def _plain(b: int, block: JointTransformerBlock, x: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
           fwd: _Forward) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The diffusers block on every token; every row's cache takes its input and output."""
    context, out = block(hidden_states=x, encoder_hidden_states=context, temb=temb)
    fwd.store(b, x, out, None)
    return context, out


@torch.inference_mode()
def _forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, caches: Sequence[PatchCache], side: int,
             run_block: _BlockRun) -> torch.Tensor:
    """`SD3Transformer2DModel.forward` with each block run by `run_block`."""
    rows = sum(cache.rows for cache in caches)
    if rows != inputs.hidden_states.shape[0]:
        raise ValueError(f"the caches hold {rows} rows, the batch {inputs.hidden_states.shape[0]} rows")
    height, width = inputs.hidden_states.shape[-2:]
    patch = transformer.config.patch_size
    grid = PatchGrid(height // patch, width // patch, side)
    blocks = transformer.transformer_blocks
    for cache in caches:
        if cache.filled and (len(cache.outputs) != len(blocks) or cache.outputs[0].shape[1] != grid.tokens):
            raise ValueError(f"a cache of {len(cache.outputs)} blocks of {cache.outputs[0].shape[1]} tokens cannot "
                             f"serve {len(blocks)} blocks of {grid.tokens} tokens")
        if cache.reused is None:
            cache.reused = torch.zeros(len(blocks), dtype=torch.long, device=inputs.hidden_states.device)
    fwd = _Forward(caches, grid, inputs.timestep.float() / TRAIN_TIMESTEPS, tuple(cache.filled for cache in caches))
    out = unrolled_forward(transformer, inputs, lambda b, block, hidden, context, temb: run_block(
        b, block, hidden, context, temb, fwd))
    for cache in caches:
        cache.steps += 1
        cache.decided += cache.rows * grid.patches
    return out
