"""`UNet2DConditionModel.forward` (diffusers 0.42) cut after its first residual block, for the
First-Block Cache: the head runs the time and text embeddings, `conv_in` and the first ResNet of
`down_blocks[0]`; the body the rest of that block (its attention, further layers and
downsampler), the other down blocks, the mid block, the up blocks and the output layers. (A
UNet's first block is its first residual unit, as a DiT's is its first transformer block: on the
shapes UNet the whole first down block is a quarter of a forward, its first ResNet a twentieth.) Unrolled as
the model's own forward runs them, so head then body is that forward bit for bit (tested). Only
what the served UNet families pass: no ControlNet or adapter residuals, attention masks, class
labels, GLIGEN or image hints (add-on groups never run through the cache)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import UNet2DConditionModel

from stepserve.engine.step_cache.first_block import SplitForward


def split_unet(unet: UNet2DConditionModel, sample: torch.Tensor, timestep: torch.Tensor,
               encoder_hidden_states: torch.Tensor, added_cond_kwargs: dict[str, torch.Tensor] | None = None
               ) -> SplitForward:
    if unet.config.class_embed_type is not None or unet.config.addition_embed_type == "image_hint":
        raise ValueError("the First-Block Cache serves UNets without class embeddings or image hints")
    # As the forward: upsample to the skip connection's size where a side is not a multiple of
    # the UNet's overall downsampling.
    upsample_sizes = any(side % 2 ** unet.num_upsamplers for side in sample.shape[-2:])

    def head() -> tuple[torch.Tensor, Any]:
        x = 2 * sample - 1.0 if unet.config.center_input_sample else sample
        emb = unet.time_embedding(unet.get_time_embed(sample=x, timestep=timestep), None)
        aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                 added_cond_kwargs=added_cond_kwargs)
        emb = emb + aug if aug is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        context = unet.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states,
                                                     added_cond_kwargs=added_cond_kwargs)
        x = unet.conv_in(x)
        first = unet.down_blocks[0].resnets[0](x, emb)
        return first, (first, x, emb, context)

    def body(carry: Any) -> torch.Tensor:
        first, stem, emb, context = carry
        x, res = _rest_of_first_down(unet.down_blocks[0], first, emb, context)
        res = (stem,) + res
        for block in unet.down_blocks[1:]:
            x, more = _down(block, x, emb, context)
            res += more
        if unet.mid_block is not None:
            if getattr(unet.mid_block, "has_cross_attention", False):
                x = unet.mid_block(x, emb, encoder_hidden_states=context, attention_mask=None,
                                   cross_attention_kwargs=None, encoder_attention_mask=None)
            else:
                x = unet.mid_block(x, emb)
        for i, block in enumerate(unet.up_blocks):
            skips, res = res[-len(block.resnets):], res[:-len(block.resnets)]
            size = res[-1].shape[2:] if i < len(unet.up_blocks) - 1 and upsample_sizes else None
            if getattr(block, "has_cross_attention", False):
                x = block(hidden_states=x, temb=emb, res_hidden_states_tuple=skips, encoder_hidden_states=context,
                          cross_attention_kwargs=None, upsample_size=size, attention_mask=None,
                          encoder_attention_mask=None)
            else:
                x = block(hidden_states=x, temb=emb, res_hidden_states_tuple=skips, upsample_size=size)
        if unet.conv_norm_out:
            x = unet.conv_act(unet.conv_norm_out(x))
        return unet.conv_out(x)

    return SplitForward(head, body, lambda last, carry: last, residual=False)


def _rest_of_first_down(block: torch.nn.Module, first: torch.Tensor, emb: torch.Tensor,
                        context: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`block.forward` (a `CrossAttnDownBlock2D` or `DownBlock2D`) from the output of its first ResNet on."""
    attentions = getattr(block, "attentions", None)
    x, out = first, ()
    for i, resnet in enumerate(block.resnets):
        if i:
            x = resnet(x, emb)
        if attentions is not None:
            x = attentions[i](x, encoder_hidden_states=context, cross_attention_kwargs=None, attention_mask=None,
                              encoder_attention_mask=None, return_dict=False)[0]
        out += (x,)
    if block.downsamplers is not None:
        for downsampler in block.downsamplers:
            x = downsampler(x)
        out += (x,)
    return x, out


def _down(block: torch.nn.Module, x: torch.Tensor, emb: torch.Tensor,
          context: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=x, temb=emb, encoder_hidden_states=context, attention_mask=None,
                     cross_attention_kwargs=None, encoder_attention_mask=None)
    return block(hidden_states=x, temb=emb)
