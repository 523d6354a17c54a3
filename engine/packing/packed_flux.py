"""One `FluxTransformer2DModel` forward over rows of different resolutions (PatchedServe §4, by
token concatenation as a DiT allows): each row gives the noise prediction it gives alone.

As in `engine.packing.packed_sd3`, every layer but attention acts on each token alone given its
row's conditioning, so the rows' image tokens are packed along one axis ([N, H], `PackedRows`)
and each token-wise layer runs once over all of them, modulated per token by its row's vectors;
attention runs per row (`kernels.varlen_attention`). What Flux adds:

- rotary position embeddings instead of a positional table: each piece's cos/sin come from its
  own joint ids (its text ids, then its size's image ids, as the model concatenates them) and
  are laid out per joined token, so each row's queries and keys rotate as they do alone;
- joint attention over each row's text tokens first, then its image tokens (`text_first`);
- single-stream blocks over the joined sequence: the rows' text and image tokens stay packed
  together ([N + rows * T, H]) through all of them, and are split once after the last;
- `norm_out` and `proj_out` on the image tokens only.

The blocks mirror `FluxTransformerBlock`, `FluxSingleTransformerBlock` and `FluxAttnProcessor`
with diffusers' own modules and `apply_rotary_emb`. ControlNet residuals, IP-adapters (another
attention processor) and fused q/k/v projections are not part of this path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (
    FluxAttention, FluxAttnProcessor, FluxSingleTransformerBlock, FluxTransformerBlock,
)

from stepserve.engine.packing.packed_rows import PackedRows
from stepserve.kernels.varlen_attention import varlen_attention

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [tokens, head_dim]


@dataclass(frozen=True)
class FluxInputs:
    """One forward's batch of B rows of one image size, named as `FluxTransformer2DModel.forward`
    names them."""

    hidden_states: torch.Tensor  # 2x2-packed latent tokens [B, n, in_channels]
    img_ids: torch.Tensor  # [n, 3]: the image tokens' position ids (one size, shared by the rows)
    encoder_hidden_states: torch.Tensor  # T5 tokens [B, T, joint_attention_dim]
    txt_ids: torch.Tensor  # [T, 3]: the text tokens' position ids
    pooled_projections: torch.Tensor  # [B, pooled_projection_dim]
    timestep: torch.Tensor  # [B], in [0, 1] (the pipeline's timesteps / 1000)
    guidance: torch.Tensor | None  # [B] where the model embeds guidance, else None


def check_supported(transformer: FluxTransformer2DModel) -> None:
    """Refuse attention this path would not reproduce: another processor (IP-adapter) or fused
    q/k/v projections, whose effect it would silently drop."""
    for block in (*transformer.transformer_blocks, *transformer.single_transformer_blocks):
        attn = block.attn
        if type(attn.processor) is not FluxAttnProcessor or attn.fused_projections:
            raise ValueError(f"packed Flux forwards run FluxAttnProcessor with unfused projections only, not "
                             f"{type(attn.processor).__name__} (fused: {attn.fused_projections})")


@torch.inference_mode()
def packed_forward(transformer: FluxTransformer2DModel, pieces: Sequence[FluxInputs]) -> list[torch.Tensor]:
    """The noise prediction of each piece ([B_i, n_i, out_channels], pieces of any sizes), as
    `transformer(...)` gives it for that piece alone, from one forward over all their rows. Rows
    of one piece share a size, so their attention runs as one batch."""
    if not pieces:
        raise ValueError("a packed forward needs at least one piece")
    texts = {p.encoder_hidden_states.shape[1] for p in pieces}
    if len(texts) > 1:
        raise ValueError(f"every row needs the same text length to pack, got text lengths {sorted(texts)}")
    if any((p.guidance is not None) != transformer.config.guidance_embeds for p in pieces):
        raise ValueError(f"every piece needs guidance exactly where the model embeds it "
                         f"(guidance_embeds={transformer.config.guidance_embeds})")
    check_supported(transformer)
    counts = [p.hidden_states.shape[0] for p in pieces]
    tokens = [p.hidden_states.shape[1] for p in pieces]
    image = transformer.x_embedder(torch.cat([p.hidden_states.flatten(0, 1) for p in pieces]))  # [N, H]
    rows = PackedRows.of([n for n, b in zip(tokens, counts) for _ in range(b)], texts.pop(), image.device,
                         text_first=True)
    rotary = _packed_rotary(transformer, pieces)

    timestep = torch.cat([p.timestep for p in pieces]).to(image.dtype) * 1000
    pooled = torch.cat([p.pooled_projections for p in pieces])
    if transformer.config.guidance_embeds:
        guidance = torch.cat([p.guidance for p in pieces]).to(image.dtype) * 1000
        temb = transformer.time_text_embed(timestep, guidance, pooled)
    else:
        temb = transformer.time_text_embed(timestep, pooled)
    context = transformer.context_embedder(torch.cat([p.encoder_hidden_states for p in pieces]))
    for block in transformer.transformer_blocks:
        context, image = packed_block(block, image, context, temb, rotary, rows)
    joined = rows.join(image, context)
    for block in transformer.single_transformer_blocks:
        joined = packed_single_block(block, joined, temb, rotary, rows)
    image, _ = rows.split(joined)

    norm = transformer.norm_out  # AdaLayerNormContinuous: scale, then shift
    scale, shift = norm.linear(norm.silu(temb).to(image.dtype)).chunk(2, dim=1)
    out = transformer.proj_out(norm.norm(image) * (1 + rows.per_token(scale)) + rows.per_token(shift))
    return [t.view(b, n, -1) for t, b, n in zip(out.split([b * n for b, n in zip(counts, tokens)]), counts, tokens)]


def _packed_rotary(transformer: FluxTransformer2DModel, pieces: Sequence[FluxInputs]) -> Rotary:
    """Each row's rotary cos/sin over its joint ids (text, then image, as the model concatenates
    them), row after row: [N + rows * T, head_dim] each, in `PackedRows.join`'s text-first order."""
    cos, sin = [], []
    for p in pieces:
        piece_cos, piece_sin = transformer.pos_embed(torch.cat((p.txt_ids, p.img_ids), dim=0))
        cos.append(piece_cos.repeat(p.hidden_states.shape[0], 1))
        sin.append(piece_sin.repeat(p.hidden_states.shape[0], 1))
    return torch.cat(cos), torch.cat(sin)


def packed_block(block: FluxTransformerBlock, image: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
                 rotary: Rotary, rows: PackedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`FluxTransformerBlock.forward` over packed image tokens `image` [N, H] and the rows' text
    tokens `context` [rows, T, H], with the rows' embeddings `temb` [rows, H]: (text output
    [rows, T, H], image output [N, H])."""
    tok = rows.per_token
    norm1 = block.norm1  # AdaLayerNormZero
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = norm1.linear(norm1.silu(temb)).chunk(6, dim=1)
    norm_image = norm1.norm(image) * (1 + tok(scale_msa)) + tok(shift_msa)
    norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(context, emb=temb)

    attn = block.attn
    queries = rows.join(_heads(attn, attn.to_q(norm_image), attn.norm_q),
                        _heads(attn, attn.add_q_proj(norm_context), attn.norm_added_q))
    keys = rows.join(_heads(attn, attn.to_k(norm_image), attn.norm_k),
                     _heads(attn, attn.add_k_proj(norm_context), attn.norm_added_k))
    values = rows.join(attn.to_v(norm_image), attn.add_v_proj(norm_context))
    image_out, text_out = rows.split(_attend(attn, queries, keys, values, rotary, rows))

    image = image + tok(gate_msa) * attn.to_out[1](attn.to_out[0](image_out))
    norm_image = block.norm2(image) * (1 + tok(scale_mlp)) + tok(shift_mlp)
    image = image + tok(gate_mlp) * block.ff(norm_image)

    context = context + c_gate_msa.unsqueeze(1) * attn.to_add_out(text_out)
    norm_context = block.norm2_context(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    context = context + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_context)
    if context.dtype == torch.float16:
        context = context.clip(-65504, 65504)
    return context, image


def packed_single_block(block: FluxSingleTransformerBlock, joined: torch.Tensor, temb: torch.Tensor,
                        rotary: Rotary, rows: PackedRows) -> torch.Tensor:
    """`FluxSingleTransformerBlock.forward` over the rows' joined text and image tokens `joined`
    [N + rows * T, H] (`rows.join`'s layout): its output in the same layout."""
    tok = rows.per_joined_token
    norm = block.norm  # AdaLayerNormZeroSingle
    shift, scale, gate = norm.linear(norm.silu(temb)).chunk(3, dim=1)
    normed = norm.norm(joined) * (1 + tok(scale)) + tok(shift)
    mlp = block.act_mlp(block.proj_mlp(normed))
    attn = block.attn
    attn_out = _attend(attn, _heads(attn, attn.to_q(normed), attn.norm_q), _heads(attn, attn.to_k(normed), attn.norm_k),
                       attn.to_v(normed), rotary, rows)
    joined = joined + tok(gate) * block.proj_out(torch.cat([attn_out, mlp], dim=1))
    if joined.dtype == torch.float16:
        joined = joined.clip(-65504, 65504)
    return joined


def _heads(attn: FluxAttention, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """x [..., heads * d] with the per-head q/k RMS norm, in the same layout: the norm acts on each
    head's d features alone, as the processor applies it to [B, S, heads, d]."""
    return norm(x.unflatten(-1, (-1, attn.head_dim))).flatten(-2)


def _attend(attn: FluxAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
            rows: PackedRows) -> torch.Tensor:
    """Joined [tokens, heads * d] in and out: queries and keys rotated by their tokens' positions,
    then attention per row over its own joined tokens."""
    q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))
    # apply_rotary_emb reads [B, S, heads, d] with the sequence at dim 1: the packed tokens are one batch of one.
    q = apply_rotary_emb(q[None], rotary, sequence_dim=1)[0]
    k = apply_rotary_emb(k[None], rotary, sequence_dim=1)[0]
    out = varlen_attention(q, k, v, rows.joined_lengths, rows.joined_lengths)
    return out.flatten(1).to(q.dtype)
