"""One SD3 `JointTransformerBlock` computed for a subset of its image tokens (InstGenIE §3.1),
in the two ways the paper describes.

- Cached outputs (Fig. 5-bottom, `masked_block_forward`): the block input holds every image
  token; queries, attention output, output projection and feed-forward are computed for the
  masked tokens only, keys and values for every token; the unmasked tokens' outputs are copied
  from the template's cached output of this block.
- Cached keys and values (Fig. 7, `keys_values_block_forward`): the block input holds the masked
  tokens only; their queries, keys and values are computed, the unmasked tokens' keys and values
  come from the template's cache of this block, and the block outputs the masked tokens only.
  Keys and values are the last thing that needs the unmasked tokens, so a forward built of these
  blocks never materializes them.

Both mirror `JointTransformerBlock.forward` and `JointAttnProcessor2_0` with diffusers' own
submodules. Text tokens are computed in full, as in the plain block, since every later block
attends to them. Every operation but attention is token-wise (the adaptive norms modulate per row,
with the row's `temb`; q/k norms act per head), so applying it to a gathered subset is exact:
given a cache recorded from the same input, either way equals the plain block within float
tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

from stepserve.kernels.masked_attention import gather_tokens, masked_query_attention, scatter_tokens, write_tokens

# (attention pair: 0 `attn`, 1 `attn2`; its module; its normed block input; the text tokens' keys and values,
# or None for `attn2`) -> the keys and values its queries attend over, [B, L (+ T), heads * d] each.
KeysValues = Callable[[int, Attention, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                      tuple[torch.Tensor, torch.Tensor]]


def masked_block_forward(
    block: JointTransformerBlock, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
    index: torch.Tensor, cached_output: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(text output, image output) of `block`, as its forward returns them: the image tokens at
    `index` [B, M] computed from the full input `hidden_states` [B, L, H], the rest copied from
    `cached_output` [B, L, H] (the template's output of this block)."""
    check_supported(block)

    def every_token(_: int, attn: Attention, norm_image: torch.Tensor, text_k: torch.Tensor | None,
                    text_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (_join(per_head(attn, attn.to_k(norm_image), attn.norm_k), text_k),
                _join(attn.to_v(norm_image), text_v))

    context, masked = _block(block, hidden_states, index, encoder_hidden_states, temb, every_token)
    return context, scatter_tokens(cached_output.to(device=masked.device, dtype=masked.dtype), index, masked)


def keys_values_block_forward(
    block: JointTransformerBlock, masked_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
    index: torch.Tensor, cached_keys_values: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(text output, masked image tokens' output [B, M, H]) of `block`, from the masked image
    tokens' input `masked_states` [B, M, H] (the tokens at `index` [B, M]) and the template's
    keys and values of this block, `cached_keys_values` [B, S, L, heads * d]: S = 2 (`attn`'s
    keys, values) or 4 in a dual-attention block (then `attn2`'s keys, values), each as the
    attention uses it (after norm1's modulation, the projection and the per-head norm)."""
    check_supported(block)
    pairs = 1 + block.use_dual_attention
    if cached_keys_values.dim() != 4 or cached_keys_values.shape[1] != 2 * pairs:
        raise ValueError(f"expected cached keys and values [B, {2 * pairs}, L, inner]; "
                         f"got {tuple(cached_keys_values.shape)}")
    cached = cached_keys_values.to(device=masked_states.device, dtype=masked_states.dtype)

    def fresh_among_cached(pair: int, attn: Attention, norm_masked: torch.Tensor, text_k: torch.Tensor | None,
                           text_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        keys = per_head(attn, attn.to_k(norm_masked), attn.norm_k)
        return (_with_cached(cached[:, 2 * pair], index, keys, text_k),
                _with_cached(cached[:, 2 * pair + 1], index, attn.to_v(norm_masked), text_v))

    return _block(block, masked_states, None, encoder_hidden_states, temb, fresh_among_cached)


def check_supported(block: JointTransformerBlock) -> None:
    """Refuse blocks whose attention runs another processor (IP-adapter, PAG, fused projections):
    the masked paths reproduce `JointAttnProcessor2_0` only, and would silently drop what another
    adds."""
    for attn in (block.attn, block.attn2):
        if attn is not None and type(attn.processor) is not JointAttnProcessor2_0:
            raise NotImplementedError(f"masked SD3 blocks run JointAttnProcessor2_0 only, not "
                                      f"{type(attn.processor).__name__}")


def _block(
    block: JointTransformerBlock, image: torch.Tensor, index: torch.Tensor | None, encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor, keys_values: KeysValues,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`JointTransformerBlock.forward` for the image tokens of `image` at `index` (None: all of
    them), attending over what `keys_values` gives: (text output, those tokens' output)."""
    computed = image if index is None else gather_tokens(image, index)
    if block.use_dual_attention:
        norm_image, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_image2, gate_msa2 = block.norm1(image, emb=temb)
    else:
        norm_image, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(image, emb=temb)

    if block.context_pre_only:
        norm_context = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
            encoder_hidden_states, emb=temb
        )

    attn = block.attn
    text_k = per_head(attn, attn.add_k_proj(norm_context), attn.norm_added_k)
    keys, values = keys_values(0, attn, norm_image, text_k, attn.add_v_proj(norm_context))
    attn_output, context_attn_output = _attention(attn, _queried(norm_image, index), keys, values, norm_context)
    computed = computed + gate_msa.unsqueeze(1) * attn_output
    if block.use_dual_attention:
        keys, values = keys_values(1, block.attn2, norm_image2, None, None)
        image_output, _ = _attention(block.attn2, _queried(norm_image2, index), keys, values, None)
        computed = computed + gate_msa2.unsqueeze(1) * image_output
    norm_computed = block.norm2(computed) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    computed = computed + gate_mlp.unsqueeze(1) * block.ff(norm_computed)

    if block.context_pre_only:
        return None, computed
    context = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_context = block.norm2_context(context) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return context + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_context), computed


def _attention(
    attn: Attention, norm_image: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    norm_context: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`JointAttnProcessor2_0` with image queries only for `norm_image` [B, M, H] over `keys`,
    `values` [B, N, heads * d] (image tokens, then text tokens, as the processor joins them):
    (those image tokens' output [B, M, H], the text tokens' output or None: `attn2` has no text,
    and a block whose text stream ends here drops its text queries)."""
    queries = [per_head(attn, attn.to_q(norm_image), attn.norm_q)]
    if norm_context is not None and not attn.context_pre_only:
        queries.append(per_head(attn, attn.add_q_proj(norm_context), attn.norm_added_q))
    out = masked_query_attention(_heads(attn, torch.cat(queries, dim=1) if len(queries) > 1 else queries[0]),
                                 _heads(attn, keys), _heads(attn, values))
    out = out.transpose(1, 2).flatten(2).to(queries[0].dtype)
    m = norm_image.shape[1]
    image_out = attn.to_out[1](attn.to_out[0](out[:, :m]))
    return image_out, (attn.to_add_out(out[:, m:]) if len(queries) > 1 else None)


def _queried(norm_image: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return norm_image if index is None else gather_tokens(norm_image, index)


def _join(image: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
    """Image then text tokens, as the processor concatenates them (only image tokens in `attn2`)."""
    return image if text is None else torch.cat([image, text], dim=1)


def _with_cached(cached: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor,
                 text: torch.Tensor | None) -> torch.Tensor:
    """The cached image tokens' keys (or values) [B, L, inner] with `fresh` [B, M, inner] at
    `index`, then the text tokens': one copy of the cache, written into in place (the cache itself
    is left as is; later edits reuse it)."""
    if text is None:
        return scatter_tokens(cached, index, fresh)
    return write_tokens(torch.cat([cached, text], dim=1), index, fresh)


def per_head(attn: Attention, x: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
    """x [B, N, heads * d] with the layer's per-head q/k norm if it has one, in the same layout:
    the norm acts on each head's d features alone, as the processor applies it to [B, heads, N, d]."""
    return x if norm is None else norm(x.unflatten(-1, (attn.heads, -1))).flatten(-2)


def _heads(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """[B, N, heads * d] -> [B, heads, N, d] (a view: attention reads the token-major layout)."""
    return x.unflatten(-1, (attn.heads, -1)).transpose(1, 2)
