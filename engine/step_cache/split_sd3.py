"""`SD3Transformer2DModel.forward` cut after its first joint block, for the First-Block Cache:
the head embeds the patches, the timestep and the text and runs block 0; the body the later
blocks (image tokens out: the last block ends the text stream); the foot the output norm,
projection and unpatchifying, for every row (a skipping row's last hidden state is its first
block's output plus its cached residual). Built on the unrolled forward of `engine.editing`."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SD3Transformer2DModel

from stepserve.engine.editing.masked_sd3 import SD3Inputs, unpatchify
from stepserve.engine.step_cache.first_block import SplitForward


def split_sd3(transformer: SD3Transformer2DModel, inputs: SD3Inputs) -> SplitForward:
    height, width = inputs.hidden_states.shape[-2:]
    blocks = transformer.transformer_blocks

    def head() -> tuple[torch.Tensor, Any]:
        hidden = transformer.pos_embed(inputs.hidden_states).contiguous()
        temb = transformer.time_text_embed(inputs.timestep, inputs.pooled_projections)
        context = transformer.context_embedder(inputs.encoder_hidden_states)
        context, hidden = blocks[0](hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        return hidden, (hidden, context, temb)

    def body(carry: Any) -> torch.Tensor:
        hidden, context, temb = carry
        for block in blocks[1:]:
            context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        return hidden

    def foot(last: torch.Tensor, carry: Any) -> torch.Tensor:
        tokens = transformer.proj_out(transformer.norm_out(last, carry[2]))
        return unpatchify(tokens, height, width, transformer.config.patch_size, transformer.out_channels)

    return SplitForward(head, body, foot, residual=True)
