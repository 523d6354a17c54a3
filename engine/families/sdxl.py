"""The Stable Diffusion XL family: two CLIP text encoders, UNet2DConditionModel with SDXL's added
conditioning (the second encoder's pooled embedding and the size micro-conditioning
`add_time_ids`), AutoencoderKL.

As SD1.5 (whose loading, scheduler, noise and decoding it shares), a diffusers
`StableDiffusionXLPipeline` is built around whichever components this process loaded, and its own
`encode_prompt` encodes, so the served result stays equal to the pipeline's. A request's rows carry
"context" (both encoders' penultimate hidden states, concatenated), "pooled" and "time_ids".
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from stepserve.engine.addons.controlnet import RemoteControlNets
from stepserve.engine.families.base import DENOISER, TEXT, VAE, RowConditioning, TextEmbeddings
from stepserve.engine.families import sd15
from stepserve.engine.families.presets import (
    autoencoder_kl, clip_text_config, preset_config, seeded_parts, vae_geometry,
)
from stepserve.engine.families.sd15 import SD15Family, SD_SCHEDULER
from stepserve.engine.tokenizer import byte_level_clip_tokenizer, byte_level_vocab
from stepserve.policies.types import RequestSpec

TEXT_2 = "text_2"  # the second text encoder, loaded with TEXT

# Tiny: the same classes, small widths (diffusers' own SDXL test sizes, scaled to 32/64 channels).
# cross_attention_dim = the two encoders' widths; the added embedding takes the pooled projection
# plus six time ids of addition_time_embed_dim each.
TINY = dict(
    text=dict(vocab_size=len(byte_level_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4),
    text_2=dict(vocab_size=len(byte_level_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, projection_dim=32),
    unet=dict(
        sample_size=32, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(4, 8), transformer_layers_per_block=(1, 1), cross_attention_dim=64,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8, norm_num_groups=8,
    ),
    vae=dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=256,
             scaling_factor=0.13025),
)

# Full size: stable-diffusion-xl-base-1.0's published component configs (random weights, for GPU
# speed runs; never build it in CPU tests).
FULL = dict(
    text=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu"),
    text_2=dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                num_attention_heads=20, projection_dim=1280, hidden_act="gelu"),
    unet=dict(
        sample_size=128, layers_per_block=2, block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816, norm_num_groups=32,
    ),
    vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, sample_size=1024,
             scaling_factor=0.13025, force_upcast=True),
)

PRESETS = {"tiny": TINY, "full": FULL}


def build_preset_components(preset: str, seed: int, parts: Collection[str], device: torch.device,
                            dtype: torch.dtype) -> dict[str, Any]:
    """Random-weight components of the real classes, each seeded on its own (as SD1.5's)."""
    cfg = preset_config(PRESETS, preset, "sdxl")
    out: dict[str, Any] = {"scheduler": EulerDiscreteScheduler(**SD_SCHEDULER)}
    builders = {  # in seed order: SD1.5's parts, then the second encoder (built with TEXT)
        TEXT: lambda: CLIPTextModel(clip_text_config(cfg["text"])),
        DENOISER: lambda: UNet2DConditionModel(in_channels=4, out_channels=4, **cfg["unet"]),
        VAE: lambda: autoencoder_kl(cfg["vae"]),
        TEXT_2: lambda: CLIPTextModelWithProjection(clip_text_config(cfg["text_2"])),
    }
    wanted = set(parts) | ({TEXT_2} if TEXT in parts else set())
    # The VAE decodes in float32 (force_upcast), so it is built in it.
    out.update(seeded_parts(builders, wanted, seed, preset, device, dtype, float32_parts={VAE}))
    if TEXT in parts:
        out["tokenizer"] = out["tokenizer_2"] = byte_level_clip_tokenizer()
    return {**out, **vae_geometry(cfg["vae"])}


# SD1.5's folder layout plus the second tokenizer and text encoder, loaded with TEXT.
FOLDER_LAYOUT = {
    **sd15.FOLDER_LAYOUT,
    TEXT: sd15.FOLDER_LAYOUT[TEXT] + (("tokenizer_2", "tokenizer_2", CLIPTokenizer),
                                      (TEXT_2, "text_encoder_2", CLIPTextModelWithProjection)),
}


def load_folder_components(path: str, parts: Collection[str]) -> dict[str, Any]:
    """Components from a local diffusers-format SDXL folder; safetensors only, never the hub."""
    out = sd15.load_folder_components(path, parts, FOLDER_LAYOUT, StableDiffusionXLPipeline)
    index = StableDiffusionXLPipeline.load_config(path)
    out["force_zeros_for_empty_prompt"] = index.get("force_zeros_for_empty_prompt", True)
    return out


class SDXLFamily(SD15Family):
    # kind, size_multiple (check_inputs: sides divisible by 8), frame_step, no SP, decoded in the
    # VAE deployment: as SD1.5.

    modules = SD15Family.modules + (TEXT_2,)
    edits = False  # StableDiffusionXLInpaintPipeline (its upcast VAE encode, denoising_start) is not replayed yet

    def __init__(self, source, components: dict[str, Any], device: torch.device,
                 remote: RemoteControlNets | None = None):
        self.force_zeros_for_empty_prompt = components.get("force_zeros_for_empty_prompt", True)
        super().__init__(source, components, device, remote)
        if self.vae is not None and self.vae.config.force_upcast:
            # The pipeline upcasts a half-precision VAE for every decode (it overflows in fp16):
            # keep it in float32 here instead.
            self.vae.to(dtype=torch.float32)

    def make_pipeline(self, components: dict[str, Any], scheduler: Any) -> Any:
        return StableDiffusionXLPipeline(
            vae=self.vae, text_encoder=components.get(TEXT), text_encoder_2=components.get(TEXT_2),
            tokenizer=components.get("tokenizer"), tokenizer_2=components.get("tokenizer_2"), unet=self.denoiser,
            scheduler=scheduler, force_zeros_for_empty_prompt=self.force_zeros_for_empty_prompt,
            add_watermarker=False,
        )

    preset_components = staticmethod(build_preset_components)
    folder_components = staticmethod(load_folder_components)

    @torch.inference_mode()
    def encode_text(self, texts: Sequence[str]) -> TextEmbeddings:
        embeds, _, pooled, _ = self.pipe.encode_prompt(list(texts), device=self.device,
                                                        do_classifier_free_guidance=False)
        return {"context": embeds, "pooled": pooled}

    def zero_negative(self, text: str) -> bool:
        return text == "" and self.force_zeros_for_empty_prompt

    def row_conditioning(self, spec: RequestSpec, text: TextEmbeddings) -> RowConditioning:
        # `_get_add_time_ids` with the pipeline's defaults: original and target size = the
        # request's, no crop; the negative rows get the same ids.
        size = (spec.height, spec.width)
        time_ids = torch.tensor([list(size + (0, 0) + size)], dtype=text["context"].dtype, device=self.device)
        return {**text, "time_ids": time_ids.repeat(text["context"].shape[0], 1)}

    def denoiser_inputs(self, cond: RowConditioning) -> dict[str, Any]:
        return {"encoder_hidden_states": cond["context"],
                "added_cond_kwargs": {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}}
