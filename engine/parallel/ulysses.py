"""Ulysses sequence parallelism for the Wan transformer, over a process group passed in.

Every rank of the group calls the transformer with the same full inputs (latents, timestep,
text) and gets the same full output; only the video's token sequence is split inside the
blocks (with it a per-token timestep, as Wan 2.2 TI2V's). Everything a Wan block does is
token-wise (norms, modulation, feed-forward, cross-attention to the text) except
self-attention, where the ranks exchange "my tokens, all heads" for "all tokens, my heads"
with one all-to-all, attend, and exchange back.

Token and head counts that do not divide by the group size are split as evenly as possible and
exchanged with uneven all-to-alls (gloo and NCCL both support split sizes), so no padding or
masking enters the attention and the result equals the unsplit forward within float tolerance.
Wan2.1-1.3B's 12 heads over 8 ranks, for example, become 2,2,2,2,1,1,1,1.

The diffusers model is not modified: for the duration of one call, forward hooks split the
rotary embedding and the blocks' input and gather the output projection, and the self-attention
processors are swapped for `UlyssesWanAttnProcessor`; all of it is undone when the call returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import dispatch_attention_fn


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """`total` items over `parts` owners, the first `total % parts` owners taking one more."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


@dataclass(frozen=True)
class UlyssesLayout:
    """Who owns which tokens (outside attention) and which heads (inside attention)."""

    rank: int
    tokens: tuple[int, ...]  # per rank, contiguous in rank order
    heads: tuple[int, ...]  # per rank, contiguous in rank order

    @classmethod
    def plan(cls, num_tokens: int, num_heads: int, world_size: int, rank: int) -> "UlyssesLayout":
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        if num_heads < world_size:
            raise ValueError(
                f"Ulysses sequence parallelism over {world_size} ranks needs at least {world_size} attention "
                f"heads; the model has {num_heads}"
            )
        if num_tokens < world_size:
            raise ValueError(
                f"Ulysses sequence parallelism over {world_size} ranks needs at least {world_size} tokens; "
                f"this video has {num_tokens} (use a smaller degree)"
            )
        return cls(rank, even_split(num_tokens, world_size), even_split(num_heads, world_size))

    @property
    def world_size(self) -> int:
        return len(self.tokens)

    @property
    def token_slice(self) -> slice:
        start = sum(self.tokens[: self.rank])
        return slice(start, start + self.tokens[self.rank])


def seq_to_heads(x: torch.Tensor, layout: UlyssesLayout, group: Any) -> torch.Tensor:
    """[B, my tokens, all heads, D] → [B, all tokens, my heads, D]."""
    batch, local, heads, dim = x.shape
    me = layout.rank
    # Rows ordered (destination, head, token): destination j gets the rows of its heads.
    send = x.permute(2, 1, 0, 3).reshape(heads * local, batch * dim)
    send_rows = [h * local for h in layout.heads]
    recv_rows = [layout.heads[me] * t for t in layout.tokens]
    recv = send.new_empty(sum(recv_rows), batch * dim)
    dist.all_to_all_single(recv, send.contiguous(), recv_rows, send_rows, group=group)
    parts = [
        chunk.reshape(layout.heads[me], t, batch, dim) for chunk, t in zip(recv.split(recv_rows), layout.tokens)
    ]
    return torch.cat(parts, dim=1).permute(2, 1, 0, 3)


def heads_to_seq(x: torch.Tensor, layout: UlyssesLayout, group: Any) -> torch.Tensor:
    """[B, all tokens, my heads, D] → [B, my tokens, all heads, D]; the inverse of `seq_to_heads`."""
    batch, _, heads, dim = x.shape
    me = layout.rank
    # Rows ordered (destination, head, token): destination i gets its own tokens.
    blocks = x.permute(2, 1, 0, 3).split(layout.tokens, dim=1)
    send = torch.cat([b.reshape(heads * b.shape[1], batch * dim) for b in blocks])
    send_rows = [heads * t for t in layout.tokens]
    local = layout.tokens[me]
    recv_rows = [h * local for h in layout.heads]
    recv = send.new_empty(sum(recv_rows), batch * dim)
    dist.all_to_all_single(recv, send, recv_rows, send_rows, group=group)
    parts = [chunk.reshape(h, local, batch, dim) for chunk, h in zip(recv.split(recv_rows), layout.heads)]
    return torch.cat(parts, dim=0).permute(2, 1, 0, 3)


def gather_tokens(x: torch.Tensor, layout: UlyssesLayout, group: Any) -> torch.Tensor:
    """[B, my tokens, C] on every rank → [B, all tokens, C] on every rank."""
    longest = max(layout.tokens)
    padded = x.contiguous()
    if x.shape[1] < longest:  # all_gather wants equal shapes
        padded = x.new_zeros(x.shape[0], longest, x.shape[2])
        padded[:, : x.shape[1]] = x
    pieces = [torch.empty_like(padded) for _ in layout.tokens]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p[:, :t] for p, t in zip(pieces, layout.tokens)], dim=1)


def _apply_rotary(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # The same arithmetic, in the same order and precision, as `WanAttnProcessor`'s rotary
    # embedding, so a split forward rounds as the unsplit one does.
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class UlyssesWanAttnProcessor:
    """Self-attention of a `WanAttention` on this rank's tokens, attending over all tokens."""

    def __init__(self, layout: UlyssesLayout, group: Any, backend: Any = None):
        self.layout = layout
        self.group = group
        self.backend = backend

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("UlyssesWanAttnProcessor handles unmasked self-attention only")
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        # RMS norm across all heads is per token, so it runs before the exchange.
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query = _apply_rotary(query, *rotary_emb)
            key = _apply_rotary(key, *rotary_emb)
        # One exchange for q, k and v together.
        batch = query.shape[0]
        qkv = seq_to_heads(torch.cat([query, key, value]), self.layout, self.group)
        query, key, value = qkv.split(batch)
        out = dispatch_attention_fn(
            query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=self.backend
        )
        out = heads_to_seq(out, self.layout, self.group)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class UlyssesWanTransformer:
    """Calls a `WanTransformer3DModel` with its token sequence split over `group`.

    `group` is a `torch.distributed` process group (or None for the default group); every rank
    of it must make the same call with the same inputs.
    """

    def __init__(self, transformer: Any, group: Any):
        self.transformer = transformer
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def layout_for(self, hidden_states: torch.Tensor) -> UlyssesLayout:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.transformer.config.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        return UlyssesLayout.plan(tokens, self.transformer.config.num_attention_heads, self.world_size, self.rank)

    def __call__(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """The transformer's `sample` output, [B, C, F, H, W], complete on every rank."""
        model = self.transformer
        call = dict(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                    return_dict=False, **kwargs)
        if self.world_size == 1:
            return model(**call)[0]
        if getattr(model, "gradient_checkpointing", False) and torch.is_grad_enabled():
            raise NotImplementedError("sequence parallelism here is for inference only")
        layout = self.layout_for(hidden_states)
        part = layout.token_slice
        if timestep.ndim == 2:
            # Per-token timesteps [B, tokens] (Wan 2.2 TI2V) split with the tokens: the model then
            # embeds only this rank's, and their modulation meets this rank's tokens in every
            # block and in the output norm, all before the gather at `proj_out`.
            call["timestep"] = timestep[:, part]

        def split_rope(module, args, output):
            return tuple(f[:, part] for f in output)

        def split_block_input(module, args):
            return (args[0][:, part].contiguous(),) + tuple(args[1:])

        def gather_output(module, args, output):
            return gather_tokens(output, layout, self.group)

        hooks = [
            model.rope.register_forward_hook(split_rope),
            model.blocks[0].register_forward_pre_hook(split_block_input),
            model.proj_out.register_forward_hook(gather_output),
        ]
        originals = [block.attn1.processor for block in model.blocks]
        try:
            for block, original in zip(model.blocks, originals):
                backend = getattr(original, "_attention_backend", None)
                block.attn1.processor = UlyssesWanAttnProcessor(layout, self.group, backend)
            return model(**call)[0]
        finally:
            for block, original in zip(model.blocks, originals):
                block.attn1.processor = original
            for hook in hooks:
                hook.remove()
