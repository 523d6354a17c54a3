"""An `SD3Transformer2DModel` forward run three ways (InstGenIE §3.1, §4.2): plain; recording
each block's image-token output (a template's activations for this step); or masked, where
blocks the caller picks compute only the masked image tokens and take the others from those
recorded activations.

The loop is the model's own forward, unrolled over diffusers' modules (patch embedding, time and
text embeddings, the blocks, the output norm and projection), so the three ways share it and the
plain way equals `transformer(...)`. Activations are cached per block because the cache is
loaded block by block, overlapped with computing the previous block; a block whose load would
stall the pipeline computes all its tokens instead (`use_cache`, decided by the bubble-free DP).
ControlNet residuals, IP-adapters and skipped layers are not part of this path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel
from diffusers.models.attention import JointTransformerBlock

from stepserve.engine.editing.masked_block import masked_block_forward

# One block step: (block number, block, image tokens, text tokens, temb) -> (text tokens, image tokens).
BlockStep = Callable[[int, JointTransformerBlock, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor | None, torch.Tensor]]


@dataclass(frozen=True)
class SD3Inputs:
    """One forward's batch of B rows, named as `SD3Transformer2DModel.forward` names them."""

    hidden_states: torch.Tensor  # latents [B, C, h, w]
    encoder_hidden_states: torch.Tensor  # text tokens [B, T, joint_attention_dim]
    pooled_projections: torch.Tensor  # [B, pooled_projection_dim]
    timestep: torch.Tensor  # [B]


@dataclass(frozen=True)
class MaskedPlan:
    """How a masked forward computes: which image tokens per row (`token_index`), the template's
    recorded output of block b for the same rows ([B, L, H], by `cached[b]` or `cached(b)`; a
    callable lets the caller load blocks as they are reached, and is asked only for blocks that
    use the cache), and which blocks use it (one bool per block; the others compute every token)."""

    index: torch.Tensor  # [B, M]
    cached: Callable[[int], torch.Tensor] | Sequence[torch.Tensor]
    use_cache: Sequence[bool]

    def cached_output(self, block: int) -> torch.Tensor:
        return self.cached(block) if callable(self.cached) else self.cached[block]


def token_index(latent_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """The masked image tokens of each row, [rows, M], in SD3's token order (row-major over the
    patch grid), from a 0/1 latent mask [rows, 1, h, w]. A patch is masked when any of its latent
    pixels is (a partly edited patch must be recomputed). Shorter rows are padded with their own
    first masked token, M being the largest count (see `stepserve.kernels.masked_attention`); a
    row with an empty mask computes token 0 alone, which keeps M >= 1 and the batch rectangular."""
    if latent_mask.dim() != 4 or latent_mask.shape[1] != 1 or any(s % patch_size for s in latent_mask.shape[-2:]):
        raise ValueError(f"expected a mask [rows, 1, h, w] with h, w multiples of {patch_size}; "
                         f"got {tuple(latent_mask.shape)}")
    masked = F.max_pool2d(latent_mask.float(), patch_size).flatten(1) > 0  # [rows, tokens]
    counts = masked.sum(dim=1)
    # A stable sort of "unmasked" puts each row's masked tokens first, in token order.
    order = torch.argsort((~masked).to(torch.uint8), dim=1, stable=True)
    width = max(int(counts.max()), 1)
    positions = torch.arange(width, device=order.device)
    return torch.where(positions < counts[:, None], order[:, :width], order[:, :1])


def plain_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs) -> torch.Tensor:
    """The noise prediction [B, C, h, w], as `transformer(...)` gives it."""
    return _forward(transformer, inputs, _full_block, record=False)[0]


def recording_forward(transformer: SD3Transformer2DModel,
                      inputs: SD3Inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The plain forward's noise prediction, and each block's image-token output [B, L, H] in
    block order: what a later masked forward of the same template and step reads as `cached`."""
    return _forward(transformer, inputs, _full_block, record=True)


def masked_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, plan: MaskedPlan) -> torch.Tensor:
    """The noise prediction [B, C, h, w] with blocks where `plan.use_cache` is set computing only
    the image tokens at `plan.index` (text tokens and every key and value in full); the other
    tokens' outputs come from the plan's cache. Equals the plain forward when the cache was
    recorded from the same inputs, or when no block uses it."""
    blocks = transformer.transformer_blocks
    if len(plan.use_cache) != len(blocks):
        raise ValueError(f"use_cache has {len(plan.use_cache)} entries for {len(blocks)} blocks")

    def step(b: int, block: JointTransformerBlock, hidden: torch.Tensor, context: torch.Tensor,
             temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if not plan.use_cache[b]:
            return _full_block(b, block, hidden, context, temb)
        return masked_block_forward(block, hidden, context, temb, plan.index, plan.cached_output(b))

    return _forward(transformer, inputs, step, record=False)[0]


def _full_block(b: int, block: JointTransformerBlock, hidden: torch.Tensor, context: torch.Tensor,
                temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    return block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)


@torch.inference_mode()
def _forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, run_block: BlockStep,
             record: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`SD3Transformer2DModel.forward` with each block run by `run_block`; the block outputs too
    when `record` (kept only then: at full size they are hundreds of MB per step)."""
    height, width = inputs.hidden_states.shape[-2:]
    hidden = transformer.pos_embed(inputs.hidden_states).contiguous()
    temb = transformer.time_text_embed(inputs.timestep, inputs.pooled_projections)
    context = transformer.context_embedder(inputs.encoder_hidden_states)
    recorded = []
    for b, block in enumerate(transformer.transformer_blocks):
        context, hidden = run_block(b, block, hidden, context, temb)
        if record:
            recorded.append(hidden)
    hidden = transformer.proj_out(transformer.norm_out(hidden, temb))
    return _unpatchify(hidden, height, width, transformer.config.patch_size, transformer.out_channels), recorded


def _unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int, channels: int) -> torch.Tensor:
    """[B, (h/p)(w/p), p*p*C] -> [B, C, h, w], as the end of `SD3Transformer2DModel.forward`."""
    grid = tokens.reshape(tokens.shape[0], height // patch, width // patch, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", grid).reshape(tokens.shape[0], channels, height, width)
