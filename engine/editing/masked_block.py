"""One SD3 `JointTransformerBlock` computed for a subset of its image tokens (InstGenIE §3.1).

Mirrors `JointTransformerBlock.forward` and `JointAttnProcessor2_0` with diffusers' own
submodules, but gives queries, attention output, output projection and feed-forward only to the
masked image tokens; keys and values come from every token of the block input. The unmasked
tokens' outputs are taken from the template's cached output of this block. Text tokens are
computed in full, as in the plain block, since every later block attends to them.

Every operation but attention is token-wise (the adaptive norms modulate per row, with the
row's `temb`), so applying it to a gathered subset is exact. Given a block input and a cache
recorded from the same input, the result equals the plain block's within float tolerance.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

from stepserve.kernels.masked_attention import gather_tokens, masked_query_attention, scatter_tokens


def masked_block_forward(
    block: JointTransformerBlock, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
    index: torch.Tensor, cached_output: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(text output, image output) of `block`, as its forward returns them: the image tokens at
    `index` [B, M] computed from the full input `hidden_states` [B, L, H], the rest copied from
    `cached_output` [B, L, H] (the template's output of this block)."""
    check_supported(block)
    masked = gather_tokens(hidden_states, index)
    if block.use_dual_attention:
        norm_all, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm2_all, gate_msa2 = block.norm1(hidden_states, emb=temb)
    else:
        norm_all, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)

    if block.context_pre_only:
        norm_context = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
            encoder_hidden_states, emb=temb
        )

    attn_output, context_attn_output = _joint_attention(block.attn, norm_all, index, norm_context)
    masked = masked + gate_msa.unsqueeze(1) * attn_output
    if block.use_dual_attention:
        masked = masked + gate_msa2.unsqueeze(1) * _self_attention(block.attn2, norm2_all, index)
    norm_masked = block.norm2(masked) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    masked = masked + gate_mlp.unsqueeze(1) * block.ff(norm_masked)
    hidden_out = scatter_tokens(cached_output.to(device=masked.device, dtype=masked.dtype), index, masked)

    if block.context_pre_only:
        return None, hidden_out
    context = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_context = block.norm2_context(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return context + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_context), hidden_out


def check_supported(block: JointTransformerBlock) -> None:
    """Refuse blocks whose attention runs another processor (IP-adapter, PAG...): the masked
    path reproduces `JointAttnProcessor2_0` only, and would silently drop what another adds."""
    for attn in (block.attn, block.attn2):
        if attn is not None and type(attn.processor) is not JointAttnProcessor2_0:
            raise NotImplementedError(f"masked SD3 blocks run JointAttnProcessor2_0 only, not "
                                      f"{type(attn.processor).__name__}")


def _joint_attention(
    attn: Attention, norm_image: torch.Tensor, index: torch.Tensor, norm_context: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`JointAttnProcessor2_0` with image queries only at `index`: (masked image tokens' output
    [B, M, H], text tokens' output or None in a block whose text stream ends here)."""
    image_q = _heads(attn, attn.to_q(gather_tokens(norm_image, index)), attn.norm_q)
    image_k = _heads(attn, attn.to_k(norm_image), attn.norm_k)
    image_v = _heads(attn, attn.to_v(norm_image))
    context_k = _heads(attn, attn.add_k_proj(norm_context), attn.norm_added_k)
    context_v = _heads(attn, attn.add_v_proj(norm_context))
    # Keys and values are joint (image tokens, then text tokens) as in the processor. The text
    # queries are only needed when the block's text stream goes on: the last block drops them.
    queries = [image_q]
    if not attn.context_pre_only:
        queries.append(_heads(attn, attn.add_q_proj(norm_context), attn.norm_added_q))
    out = masked_query_attention(torch.cat(queries, dim=2), torch.cat([image_k, context_k], dim=2),
                                 torch.cat([image_v, context_v], dim=2))
    out = _merge_heads(out).to(image_q.dtype)
    m = index.shape[1]
    image_out = attn.to_out[1](attn.to_out[0](out[:, :m]))
    return image_out, (None if attn.context_pre_only else attn.to_add_out(out[:, m:]))


def _self_attention(attn: Attention, norm_image: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The dual-attention layer's image-only attention (`JointAttnProcessor2_0` without text),
    queries only at `index`: [B, M, H]."""
    q = _heads(attn, attn.to_q(gather_tokens(norm_image, index)), attn.norm_q)
    k = _heads(attn, attn.to_k(norm_image), attn.norm_k)
    v = _heads(attn, attn.to_v(norm_image))
    out = _merge_heads(masked_query_attention(q, k, v)).to(q.dtype)
    return attn.to_out[1](attn.to_out[0](out))


def _heads(attn: Attention, x: torch.Tensor, norm: torch.nn.Module | None = None) -> torch.Tensor:
    """[B, N, heads * d] -> [B, heads, N, d], then the per-head q/k norm if the layer has one."""
    batch, tokens, inner = x.shape
    x = x.view(batch, tokens, attn.heads, inner // attn.heads).transpose(1, 2)
    return x if norm is None else norm(x)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    batch, heads, tokens, d = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * d)
