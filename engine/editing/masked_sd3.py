"""An `SD3Transformer2DModel` forward run three ways (InstGenIE §3.1, §4.2): plain; recording a
template's activations for this step; or masked, computing only the masked image tokens and
taking the others' part from those recorded activations.

What is recorded is the cache kind (`CacheKind`), one tensor per cache slot in slot order:

- `OUTPUTS` (the paper's approach, Fig. 5-bottom): slot b is block b's image-token output
  [B, L, H]. A masked block takes the full block input (the masked tokens as computed, the others
  from the previous block's cached output), so keys and values still cover every token, and a
  block may compute all its tokens instead (`use_cache`, decided by the bubble-free DP).
- `KEYS_VALUES` (the paper's alternative, Fig. 7): slot b is block b's image-token keys and
  values as its attention uses them, [B, S, L, heads * d] with S = 2 (`attn`'s keys, values) or
  4 in a dual-attention block (then `attn2`'s keys, values); slot `blocks` (one more) is the
  model's final image tokens after `norm_out` and `proj_out`, [B, L, p * p * C], before
  unpatchifying. A masked forward gathers the masked tokens after the patch embedding and never
  materializes the others: each block computes queries, keys and values of the masked tokens
  only, among the cached keys and values of the rest, and its feed-forward for them only; the
  output layer runs on the masked tokens and scatters them into the cached final tokens. As no
  block has the unmasked tokens' inputs, every slot uses the cache (`use_cache` all set). The
  final tokens rather than the last block's output are cached because the output layer is
  token-wise, so the masked forward still equals the plain one given its own record, while the
  slot is p * p * C / H of the size (64 against 1536 for SD3-medium) and the output layer runs
  for the masked tokens only.

The loop is the model's own forward, unrolled over diffusers' modules (patch embedding, time and
text embeddings, the blocks, the output norm and projection), so every way shares it and the
plain way equals `transformer(...)`; recording runs the plain blocks themselves (keys and values
are taken with forward hooks on the modules that produce them), so a record's noise prediction is
the plain one. Activations are cached per slot because the cache is loaded slot by slot,
overlapped with computing the previous block (`engine.editing.block_loader`). ControlNet
residuals, IP-adapters and skipped layers are not part of this path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel
from diffusers.models.attention import JointTransformerBlock

from stepserve.engine.editing.masked_block import check_supported, keys_values_block_forward, masked_block_forward
from stepserve.kernels.masked_attention import gather_tokens, scatter_tokens

# One block step: (block number, block, image tokens, text tokens, temb) -> (text tokens, image tokens).
BlockStep = Callable[[int, JointTransformerBlock, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor | None, torch.Tensor]]
TokenStep = Callable[[torch.Tensor], torch.Tensor]


class CacheKind(str, Enum):
    """What a template's record holds for one forward (see the module docstring)."""

    OUTPUTS = "outputs"  # each block's image-token output
    KEYS_VALUES = "keys_values"  # each block's image-token keys and values, then the final image tokens


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
    record for the same rows (slot s by `cached[s]` or `cached(s)`; a callable lets the caller
    load slots as they are reached, and is asked only for slots in use, in slot order), which
    slots use it (one bool per slot, `cache_slots`; an `OUTPUTS` block that does not use it
    computes every token), and the record's kind. A `KEYS_VALUES` plan uses every slot: its blocks never
    see the unmasked tokens, so none can compute them."""

    index: torch.Tensor  # [B, M]
    cached: Callable[[int], torch.Tensor] | Sequence[torch.Tensor]
    use_cache: Sequence[bool]
    kind: CacheKind = CacheKind.OUTPUTS

    def __post_init__(self) -> None:
        if CacheKind(self.kind) is CacheKind.KEYS_VALUES and not all(self.use_cache):
            raise ValueError("a keys_values cache must be used by every slot: a block computing every token would "
                             "need the unmasked tokens' inputs, which a keys_values forward never computes")

    def cached_slot(self, slot: int) -> torch.Tensor:
        return self.cached(slot) if callable(self.cached) else self.cached[slot]


def cache_slots(transformer: SD3Transformer2DModel, kind: CacheKind = CacheKind.OUTPUTS) -> int:
    """Tensors in one forward's record of `kind`: one per block, one more (the final image
    tokens) for `KEYS_VALUES`."""
    return len(transformer.transformer_blocks) + (CacheKind(kind) is CacheKind.KEYS_VALUES)


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
    return unrolled_forward(transformer, inputs, _full_block)


def recording_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs,
                      kind: CacheKind = CacheKind.OUTPUTS) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The plain forward's noise prediction, and its record of `kind`: `cache_slots` tensors in
    slot order (see the module docstring), what a later masked forward of the same template and
    step reads as `cached`."""
    recorded: list[torch.Tensor] = []
    if CacheKind(kind) is CacheKind.OUTPUTS:
        def step(b: int, block: JointTransformerBlock, hidden: torch.Tensor, context: torch.Tensor,
                 temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
            context, hidden = _full_block(b, block, hidden, context, temb)
            recorded.append(hidden)
            return context, hidden
        return unrolled_forward(transformer, inputs, step), recorded

    def recorded_final(tokens: torch.Tensor) -> torch.Tensor:
        recorded.append(tokens)
        return tokens

    return unrolled_forward(transformer, inputs, _keys_values_recorder(recorded), out_tokens=recorded_final), recorded


def masked_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, plan: MaskedPlan) -> torch.Tensor:
    """The noise prediction [B, C, h, w] computing only the image tokens at `plan.index` (text
    tokens in full) wherever `plan.use_cache` is set; the other tokens' part comes from the plan's
    record. `OUTPUTS`: blocks using the cache take the others' outputs from it, and compute keys
    and values of every token. `KEYS_VALUES`: every block takes the others' keys and values from
    it, and the output layer their final tokens. Equals the plain forward when the record is of
    the same inputs, or when every token is masked, or when no block uses an `OUTPUTS` cache."""
    blocks = transformer.transformer_blocks
    slots = cache_slots(transformer, plan.kind)
    if len(plan.use_cache) != slots:
        what = f"{len(blocks)} blocks" + ("" if slots == len(blocks) else " and the final tokens")
        raise ValueError(f"use_cache has {len(plan.use_cache)} entries for {slots} cache slots ({what})")

    if CacheKind(plan.kind) is CacheKind.KEYS_VALUES:
        def kv_step(b: int, block: JointTransformerBlock, masked: torch.Tensor, context: torch.Tensor,
                    temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
            return keys_values_block_forward(block, masked, context, temb, plan.index, plan.cached_slot(b))

        def final(masked: torch.Tensor) -> torch.Tensor:
            cached = plan.cached_slot(len(blocks)).to(device=masked.device, dtype=masked.dtype)
            return scatter_tokens(cached, plan.index, masked)

        return unrolled_forward(transformer, inputs, kv_step, image_tokens=lambda h: gather_tokens(h, plan.index),
                        out_tokens=final)

    def step(b: int, block: JointTransformerBlock, hidden: torch.Tensor, context: torch.Tensor,
             temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        if not plan.use_cache[b]:
            return _full_block(b, block, hidden, context, temb)
        return masked_block_forward(block, hidden, context, temb, plan.index, plan.cached_slot(b))

    return unrolled_forward(transformer, inputs, step)


def _full_block(b: int, block: JointTransformerBlock, hidden: torch.Tensor, context: torch.Tensor,
                temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    return block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)


def _keys_values_recorder(recorded: list[torch.Tensor]) -> BlockStep:
    """The plain block step, appending each block's image-token keys and values to `recorded` as
    [B, S, L, heads * d] (`keys_values_block_forward`'s layout). They are taken from the plain
    block's own modules with forward hooks, so the record is exactly what its attention used: a
    key from the per-head norm when the layer has one (whose output is [B, heads, L, d]), else
    from the projection; a value from the projection."""
    def step(b: int, block: JointTransformerBlock, hidden: torch.Tensor, context: torch.Tensor,
             temb: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        check_supported(block)  # another processor may not call the hooked modules the same way
        attns = [attn for attn in (block.attn, block.attn2) if attn is not None]
        captured: dict[int, torch.Tensor] = {}

        def keep(slot: int) -> Callable[[torch.nn.Module, object, torch.Tensor], None]:
            def hook(_: torch.nn.Module, __: object, output: torch.Tensor) -> None:
                captured[slot] = output.transpose(1, 2).flatten(2) if output.dim() == 4 else output
            return hook

        hooks = []
        for pair, attn in enumerate(attns):
            keys = attn.to_k if attn.norm_k is None else attn.norm_k
            hooks += [keys.register_forward_hook(keep(2 * pair)), attn.to_v.register_forward_hook(keep(2 * pair + 1))]
        try:
            out = _full_block(b, block, hidden, context, temb)
        finally:
            for hook in hooks:
                hook.remove()
        recorded.append(torch.stack([captured[slot] for slot in range(2 * len(attns))], dim=1))
        return out
    return step


@torch.inference_mode()
def unrolled_forward(transformer: SD3Transformer2DModel, inputs: SD3Inputs, run_block: BlockStep,
             image_tokens: TokenStep | None = None, out_tokens: TokenStep | None = None) -> torch.Tensor:
    """`SD3Transformer2DModel.forward` with each block run by `run_block`; `image_tokens` maps the
    patch embedding's tokens to those the blocks compute, `out_tokens` the output layer's tokens
    to all of them (`KEYS_VALUES`: gathering the masked ones, scattering them into the cache)."""
    height, width = inputs.hidden_states.shape[-2:]
    hidden = transformer.pos_embed(inputs.hidden_states).contiguous()
    if image_tokens is not None:
        hidden = image_tokens(hidden)
    temb = transformer.time_text_embed(inputs.timestep, inputs.pooled_projections)
    context = transformer.context_embedder(inputs.encoder_hidden_states)
    for b, block in enumerate(transformer.transformer_blocks):
        context, hidden = run_block(b, block, hidden, context, temb)
    tokens = transformer.proj_out(transformer.norm_out(hidden, temb))
    if out_tokens is not None:
        tokens = out_tokens(tokens)
    return unpatchify(tokens, height, width, transformer.config.patch_size, transformer.out_channels)


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int, channels: int) -> torch.Tensor:
    """[B, (h/p)(w/p), p*p*C] -> [B, C, h, w], as the end of `SD3Transformer2DModel.forward`."""
    grid = tokens.reshape(tokens.shape[0], height // patch, width // patch, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", grid).reshape(tokens.shape[0], channels, height, width)
