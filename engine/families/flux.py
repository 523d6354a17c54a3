"""The Flux.1 family: CLIP (pooled) and T5 text encoders, FluxTransformer2DModel, the 16-channel
AutoencoderKL, sampled by flow-matching Euler.

As SD1.5, a diffusers `FluxPipeline` is built around whichever components this process loaded
and its own methods encode prompts and post-process images, so the served result stays equal to
the pipeline's. Flux is guidance-distilled: a request adds one row to a forward and its
`guidance_scale` is a per-row input ("guidance"), not a second, unconditional row.

The pipeline packs latents into 2x2 patch tokens for its whole loop; here a request's latents
stay unpacked ([1, C, h, w], as the other image families keep theirs) and only the forward
packs them. Flow-matching Euler's step is elementwise, so stepping the unpacked latents equals
stepping the packed ones, and the unpacked shape tells sizes apart that pack to the same token
count (64x128 and 128x64), whose position ids differ: they never share a batch of one size.

Requests of different sizes do share a forward (PatchedServe §4): `denoise_mixed` concatenates
their image tokens, each size with its own position ids (`engine.packing.packed_flux`), one
piece per exact latent shape, so 64x128 and 128x64 go in as two pieces.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from stepserve.engine.addons.controlnet import RemoteControlNets
from stepserve.engine.families import sd15
from stepserve.engine.families.base import DENOISER, TEXT, VAE, ModelSource, RowConditioning, TextEmbeddings
from stepserve.engine.families.flow_matching import FlowMatchingImageFamily
from stepserve.engine.families.presets import (
    autoencoder_kl, clip_text_config, preset_config, seeded_parts, t5_encoder, vae_geometry,
)
from stepserve.engine.families.sdxl import TEXT_2
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.packing.packed_flux import FluxInputs, packed_forward
from stepserve.engine.packing.pieces import denoise_by_shape
from stepserve.engine.tokenizer import (
    byte_level_clip_tokenizer, byte_level_vocab, character_t5_tokenizer, t5_character_vocab,
)
from stepserve.policies.types import RequestSpec

# FLUX.1-dev's published scheduler: flow-matching Euler, its sigmas shifted by the image's token count.
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096,
)
# Flux's VAE: 16 latent channels with its own scale and shift, no quant convolutions.
FLUX_VAE = dict(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)
MAX_SEQUENCE_LENGTH = 512  # `FluxPipeline.__call__`'s default, and the most its `check_inputs` allows

# Tiny: the same classes, small widths. in_channels 64 = 16 latent channels x one 2x2 patch (the
# pipeline packs the patches, so the transformer's own patch_size stays 1); the rope axes add
# up to the head width. The VAE keeps four blocks (8x) and Flux's 16 channels, scale and shift.
TINY = dict(
    text=dict(vocab_size=len(byte_level_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4),
    text_2=dict(
        vocab_size=len(t5_character_vocab()), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
    ),
    transformer=dict(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
    vae=dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=256,
             **FLUX_VAE),
    max_sequence_length=32,
)

# Full size: FLUX.1-dev's transformer, CLIP-L (as SD1.5's), T5-XXL's encoder and Flux's VAE
# (random weights, for GPU speed runs; never build it in CPU tests).
FULL = dict(
    text=sd15.FULL["text"],
    text_2=dict(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
    ),
    transformer=dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, sample_size=1024,
             **FLUX_VAE),
    max_sequence_length=MAX_SEQUENCE_LENGTH,
)

PRESETS = {"tiny": TINY, "full": FULL}


def build_preset_components(preset: str, seed: int, parts: Collection[str], device: torch.device,
                            dtype: torch.dtype) -> dict[str, Any]:
    """Random-weight components of the real classes, each seeded on its own (as SD1.5's)."""
    cfg = preset_config(PRESETS, preset, "flux")
    out: dict[str, Any] = {"scheduler": FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)}
    builders = {  # in seed order: SD1.5's parts, then T5 (built with TEXT)
        TEXT: lambda: CLIPTextModel(clip_text_config(cfg["text"])),
        DENOISER: lambda: FluxTransformer2DModel(**cfg["transformer"]),
        VAE: lambda: autoencoder_kl(cfg["vae"]),
        TEXT_2: lambda: t5_encoder(cfg["text_2"]),
    }
    wanted = set(parts) | ({TEXT_2} if TEXT in parts else set())
    out.update(seeded_parts(builders, wanted, seed, preset, device, dtype))
    if TEXT in parts:
        out["tokenizer"] = byte_level_clip_tokenizer()
        out["tokenizer_2"] = character_t5_tokenizer(cfg["max_sequence_length"])
    return {**out, **vae_geometry(cfg["vae"])}


# What a diffusers Flux folder holds for each part: (component key, subfolder, class).
FOLDER_LAYOUT = {
    TEXT: (("tokenizer", "tokenizer", CLIPTokenizer), (TEXT, "text_encoder", CLIPTextModel),
           # Real folders name T5TokenizerFast, which transformers 5 folds into T5Tokenizer.
           ("tokenizer_2", "tokenizer_2", T5Tokenizer), (TEXT_2, "text_encoder_2", T5EncoderModel)),
    DENOISER: ((DENOISER, "transformer", FluxTransformer2DModel),),
    VAE: sd15.FOLDER_LAYOUT[VAE],
}


def load_folder_components(path: str, parts: Collection[str]) -> dict[str, Any]:
    """Components from a local diffusers-format Flux folder; safetensors only, never the hub."""
    return sd15.load_folder_components(path, parts, FOLDER_LAYOUT, FluxPipeline)


class FluxFamily(FlowMatchingImageFamily):
    # An image family decoded in the VAE deployment, as SD1.5. Sides are multiples of the VAE's
    # 8x times the 2x2 packing (the pipeline would resize others, with a warning);
    # `__init__` checks the weights agree.
    classifier_free_guidance = False  # guidance-distilled: the scale is a model input
    modules = FlowMatchingImageFamily.modules + (TEXT_2,)
    edits = False  # FluxInpaintPipeline (packed latents) is not replayed yet
    forward_modes = frozenset({ModeName.PACKED})

    def __init__(self, source: ModelSource, components: dict[str, Any], device: torch.device,
                 remote: RemoteControlNets | None = None):
        super().__init__(source, components, device, remote)
        if self.vae_scale_factor * 2 != self.size_multiple:
            raise ValueError(f"model {source.name!r}: VAE {self.vae_scale_factor}x times the 2x2 packing is not "
                             f"the flux family's size multiple {self.size_multiple}")
        if TEXT in components:
            # The T5 tokenizer's own length (a real Flux folder's is the pipeline's 512), within
            # the pipeline's limit; the golden references call the pipeline with it.
            self.max_sequence_length = min(components["tokenizer_2"].model_max_length, MAX_SEQUENCE_LENGTH)

    def make_pipeline(self, components: dict[str, Any], scheduler: Any) -> Any:
        return FluxPipeline(
            scheduler=scheduler, vae=self.vae, text_encoder=components.get(TEXT), tokenizer=components.get("tokenizer"),
            text_encoder_2=components.get(TEXT_2), tokenizer_2=components.get("tokenizer_2"),
            transformer=self.denoiser,
        )

    preset_components = staticmethod(build_preset_components)
    folder_components = staticmethod(load_folder_components)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """One image's unpacked latents, as `FluxPipeline.prepare_latents` sizes them before packing."""
        pack = self.vae_scale_factor * 2
        return (1, self.latent_channels, 2 * (height // pack), 2 * (width // pack))

    @torch.inference_mode()
    def encode_text(self, texts: Sequence[str]) -> TextEmbeddings:
        """"context" (T5) [n, max_sequence_length, dim] and "pooled" (CLIP) [n, dim]. Both encoders
        pad every text to a fixed length, so a text's embeddings do not depend on its batch mates."""
        context, pooled, _ = self.pipe.encode_prompt(
            list(texts), device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"context": context, "pooled": pooled}

    def row_conditioning(self, spec: RequestSpec, text: TextEmbeddings) -> RowConditioning:
        # The pipeline's `torch.full([1], guidance_scale, dtype=float32).expand(batch)`.
        rows = text["context"].shape[0]
        guidance = torch.full([rows], spec.guidance_scale, dtype=torch.float32, device=self.device)
        return {**text, "guidance": guidance}

    def prepare_scheduler(self, scheduler: Any, spec: RequestSpec) -> None:
        # As the pipeline: its own sigmas (unless the scheduler makes flow sigmas itself), shifted
        # by the packed token count, and steps counted from 0 instead of looked up.
        steps = spec.num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        _, _, h, w = self.latent_shape(spec.height, spec.width)
        config = scheduler.config
        mu = calculate_shift(
            (h // 2) * (w // 2), config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )
        retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)

    def initial_latents(self, spec: RequestSpec, scheduler: Any, generator: torch.Generator) -> torch.Tensor:
        # `FluxPipeline.prepare_latents` draws this shape, in the text embeddings' dtype, then packs it.
        return randn_tensor(self.latent_shape(spec.height, spec.width), generator=generator, device=self.device,
                            dtype=self.dtype)

    def _inputs(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning) -> FluxInputs:
        """The transformer's inputs for unpacked latents [B, C, h, w] of one image size, as the
        pipeline gives them: 2x2 patch tokens, their position ids, zero text ids, timesteps / 1000."""
        batch, channels, height, width = sample.shape
        context = cond["context"]
        return FluxInputs(
            hidden_states=FluxPipeline._pack_latents(sample, batch, channels, height, width),
            img_ids=FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, self.device, context.dtype),
            encoder_hidden_states=context,
            txt_ids=torch.zeros(context.shape[1], 3, device=self.device, dtype=context.dtype),
            pooled_projections=cond["pooled"],
            timestep=timesteps.to(sample.dtype) / 1000,
            # Flux-schnell has no guidance embedding; the pipeline then passes none.
            guidance=cond["guidance"] if self.denoiser.config.guidance_embeds else None,
        )

    @torch.inference_mode()
    def denoise(
        self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning, sp_group: Any = None
    ) -> torch.Tensor:
        """One forward over unpacked latents [B, C, h, w] of one image size: packed into 2x2 patch
        tokens for the transformer, its output unpacked again."""
        self.refuse_sequence_parallel(sp_group)
        args = self._inputs(sample, timesteps, cond)
        out = self.denoiser(
            hidden_states=args.hidden_states, timestep=args.timestep, guidance=args.guidance,
            pooled_projections=args.pooled_projections, encoder_hidden_states=args.encoder_hidden_states,
            txt_ids=args.txt_ids, img_ids=args.img_ids, return_dict=False,
        )[0]
        # `_unpack_latents` takes pixel sizes; with a scale factor of 1 it takes these latent ones.
        return FluxPipeline._unpack_latents(out, *sample.shape[-2:], 1)

    def packs(self, sizes: Sequence[tuple[int, ...]]) -> bool:
        return True  # tokens of any sizes concatenate (every latent side is a multiple of the 2x2 packing)

    @torch.inference_mode()
    def denoise_mixed(
        self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor, RowConditioning]]
    ) -> list[torch.Tensor]:
        """`denoise` of each (sample, timesteps, cond) of `inputs`, samples of any latent sizes, as
        one forward with their image tokens packed (`engine.packing.packed_flux`), a piece per
        latent shape (`engine.packing.pieces`: 64x128 and 128x64, of equal token counts, are two)."""

        def forward(pieces):
            tokens = packed_forward(self.denoiser, [self._inputs(*piece) for piece in pieces])
            return [FluxPipeline._unpack_latents(out, *sample.shape[-2:], 1)
                    for out, (sample, _, _) in zip(tokens, pieces)]

        return denoise_by_shape(inputs, forward)
