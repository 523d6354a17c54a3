"""One `SD3Transformer2DModel` forward over rows of different resolutions (PatchedServe §4, by
token concatenation as a DiT allows): each row gives the noise prediction it gives alone.

Every layer of an MMDiT but attention acts on each token alone, given its row's conditioning:
linears, layer norms, the feed-forwards, q/k RMS norms, and the adaptive norms, whose shift,
scale and gate come from the row's time and pooled-text embedding. So the rows' image tokens
are packed along one axis ([N, H], `PackedRows`) and each of those layers runs once over all
of them, each token modulated by its own row's vectors; text tokens keep their [rows, T, H]
batch (every row has SD3's fixed text length). Attention runs per row over that row's own
image and text tokens (`kernels.varlen_attention`). Each row is patch-embedded with the
positional table cropped to its own size, as diffusers' `PatchEmbed` does for a batch of that
size, and unpatchified to its own size.

The block mirrors `JointTransformerBlock.forward` and `JointAttnProcessor2_0` with diffusers'
own modules, as `engine.editing.masked_block` does for masked edits: SD3.5's second image-only
attention (`dual_attention_layers`), q/k norms, and the last block, whose text stream ends
(`context_pre_only`: its text queries are dropped, as they change no image token). ControlNet
residuals, IP-adapters and skipped layers are not part of this path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention

from stepserve.engine.editing.masked_block import check_supported, per_head
from stepserve.engine.editing.masked_sd3 import SD3Inputs, unpatchify
from stepserve.engine.packing.packed_rows import PackedRows
from stepserve.kernels.varlen_attention import varlen_attention


@torch.inference_mode()
def packed_forward(transformer: SD3Transformer2DModel, pieces: Sequence[SD3Inputs]) -> list[torch.Tensor]:
    """The noise prediction of each piece ([B_i, C, h_i, w_i], pieces of any sizes), as
    `transformer(...)` gives it for that piece alone, from one forward over all their rows. Rows
    of one piece share a size, so their attention runs as one batch."""
    if not pieces:
        raise ValueError("a packed forward needs at least one piece")
    texts = {tuple(p.encoder_hidden_states.shape[1:]) for p in pieces}
    if len(texts) > 1:
        raise ValueError(f"every row needs the same text length to pack, got text shapes {sorted(texts)}")
    for block in transformer.transformer_blocks:
        check_supported(block)
    patch = transformer.config.patch_size
    sizes = [tuple(p.hidden_states.shape[-2:]) for p in pieces]
    counts = [p.hidden_states.shape[0] for p in pieces]
    lengths = [(h // patch) * (w // patch) for (h, w), n in zip(sizes, counts) for _ in range(n)]

    image = torch.cat([transformer.pos_embed(p.hidden_states).flatten(0, 1) for p in pieces])  # [N, H]
    rows = PackedRows.of(lengths, texts.pop()[0], image.device)
    temb = transformer.time_text_embed(torch.cat([p.timestep for p in pieces]),
                                       torch.cat([p.pooled_projections for p in pieces]))
    context = transformer.context_embedder(torch.cat([p.encoder_hidden_states for p in pieces]))
    for block in transformer.transformer_blocks:
        context, image = packed_block(block, image, context, temb, rows)

    norm = transformer.norm_out  # AdaLayerNormContinuous: scale, then shift
    scale, shift = norm.linear(norm.silu(temb).to(image.dtype)).chunk(2, dim=1)
    tokens = transformer.proj_out(norm.norm(image) * (1 + rows.per_token(scale)) + rows.per_token(shift))
    per_piece = tokens.split([n * (h // patch) * (w // patch) for (h, w), n in zip(sizes, counts)])
    return [unpatchify(t.view(n, -1, t.shape[-1]), h, w, patch, transformer.out_channels)
            for t, n, (h, w) in zip(per_piece, counts, sizes)]


def packed_block(block: JointTransformerBlock, image: torch.Tensor, context: torch.Tensor, temb: torch.Tensor,
                 rows: PackedRows) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`JointTransformerBlock.forward` over packed image tokens `image` [N, H] and the rows' text
    tokens `context` [rows, T, H], with the rows' embeddings `temb` [rows, H]: (text output, or
    None where the text stream ends; image output [N, H])."""
    tok = rows.per_token
    norm1 = block.norm1  # AdaLayerNormZero, or SD35AdaLayerNormZeroX with a second attention's vectors
    mods = norm1.linear(norm1.silu(temb)).chunk(9 if block.use_dual_attention else 6, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[:6]
    normed = norm1.norm(image)
    norm_image = normed * (1 + tok(scale_msa)) + tok(shift_msa)

    if block.context_pre_only:
        norm_context = block.norm1_context(context, temb)
    else:
        norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(context, emb=temb)

    attn_output, context_attn_output = _joint_attention(block.attn, norm_image, norm_context, rows)
    image = image + tok(gate_msa) * attn_output
    if block.use_dual_attention:
        shift_msa2, scale_msa2, gate_msa2 = mods[6:]
        attn2 = block.attn2
        norm_image2 = normed * (1 + tok(scale_msa2)) + tok(shift_msa2)
        out = _attend(attn2, per_head(attn2, attn2.to_q(norm_image2), attn2.norm_q),
                      per_head(attn2, attn2.to_k(norm_image2), attn2.norm_k), attn2.to_v(norm_image2),
                      rows.lengths, rows.lengths)
        image = image + tok(gate_msa2) * attn2.to_out[1](attn2.to_out[0](out))
    norm_image = block.norm2(image) * (1 + tok(scale_mlp)) + tok(shift_mlp)
    image = image + tok(gate_mlp) * block.ff(norm_image)

    if block.context_pre_only:
        return None, image
    context = context + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_context = block.norm2_context(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return context + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_context), image


def _joint_attention(attn: Attention, norm_image: torch.Tensor, norm_context: torch.Tensor,
                     rows: PackedRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`JointAttnProcessor2_0` per row over packed tokens: each row's image (and text) queries
    over its own image then text keys and values. (image output [N, H], text output [rows, T, H]
    or None where the text stream ends: then text queries are not computed.)"""
    keys = rows.join(per_head(attn, attn.to_k(norm_image), attn.norm_k),
                     per_head(attn, attn.add_k_proj(norm_context), attn.norm_added_k))
    values = rows.join(attn.to_v(norm_image), attn.add_v_proj(norm_context))
    image_queries = per_head(attn, attn.to_q(norm_image), attn.norm_q)
    if attn.context_pre_only:
        out = _attend(attn, image_queries, keys, values, rows.lengths, rows.joined_lengths)
        return attn.to_out[1](attn.to_out[0](out)), None
    queries = rows.join(image_queries, per_head(attn, attn.add_q_proj(norm_context), attn.norm_added_q))
    image_out, text_out = rows.split(_attend(attn, queries, keys, values, rows.joined_lengths, rows.joined_lengths))
    return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


def _attend(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Sequence[int],
            kv_lengths: Sequence[int]) -> torch.Tensor:
    """Packed [tokens, heads * d] in and out, attention per sequence."""
    out = varlen_attention(q.unflatten(-1, (attn.heads, -1)), k.unflatten(-1, (attn.heads, -1)),
                           v.unflatten(-1, (attn.heads, -1)), q_lengths, kv_lengths)
    return out.flatten(1).to(q.dtype)
