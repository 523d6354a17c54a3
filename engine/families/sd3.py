"""The Stable Diffusion 3 / 3.5 family: CLIP-L + CLIP-G + T5 text encoders, SD3Transformer2DModel
(MMDiT), AutoencoderKL with 16 latent channels, a flow-matching Euler scheduler.

As SD1.5 (whose loading and pipeline-as-helper it shares), a diffusers `StableDiffusion3Pipeline`
is built around whichever components this process loaded, and its own `encode_prompt` encodes,
so the served result stays equal to the pipeline's. A request's rows carry "context" (both CLIP
encoders' penultimate states, zero-padded to T5's width, followed by T5's tokens) and "pooled"
(both CLIP projections). Flow matching needs no noise scaling: a request's timesteps are its
sigmas times 1000, shifted by the model's schedule (and by its image size where the scheduler
shifts dynamically), set on its own scheduler.
"""

from __future__ import annotations

import json
import os
from typing import Any, Collection, Sequence

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from stepserve.engine.addons.controlnet import RemoteControlNets
from stepserve.engine.editing.block_costs import BlockCosts, measure_block_costs
from stepserve.engine.editing.masked_sd3 import (
    CacheKind, MaskedPlan, SD3Inputs, cache_slots, masked_forward, recording_forward,
)
from stepserve.engine.families import sd15
from stepserve.engine.families.base import DENOISER, TEXT, VAE, ModelSource, RowConditioning, TextEmbeddings
from stepserve.engine.families.flow_matching import FlowMatchingImageFamily
from stepserve.engine.families.presets import (
    autoencoder_kl, clip_text_config, preset_config, seeded_parts, t5_encoder, vae_geometry,
)
from stepserve.engine.families.sdxl import TEXT_2
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.packing.packed_sd3 import packed_forward
from stepserve.engine.packing.pieces import denoise_by_shape
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse, patch_cached_forward
from stepserve.engine.step_cache.first_block import FirstBlockCache, first_block_cached
from stepserve.engine.step_cache.split_sd3 import split_sd3
from stepserve.engine.tokenizer import byte_level_clip_tokenizer, byte_level_vocab, character_t5_tokenizer, \
    t5_character_vocab
from stepserve.policies.instgenie.edit_costs import DiTDims
from stepserve.policies.types import RequestSpec

TEXT_3 = "text_3"  # the T5 encoder, loaded with TEXT
MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.__call__'s default T5 length
CLIP_TOKENS = 77  # the pipeline pads CLIP prompts to its tokenizers' length, before T5's tokens

# SD3-medium's and SD3.5's published scheduler: flow matching, timesteps shifted by 3.
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)

# Tiny: the same classes, small widths, with SD3.5's additions (qk RMS norm, a dual-attention
# layer). T5 is as wide as both CLIPs together, so the pipeline's zero-padding of the CLIP states
# to T5's width holds, as in the real model (768 + 1280 < 4096); the positional table covers
# 512 px (64 latents / patch 2).
TINY = dict(
    text=dict(vocab_size=len(byte_level_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, projection_dim=32),
    text_2=dict(vocab_size=len(byte_level_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, projection_dim=32),
    text_3=dict(vocab_size=len(t5_character_vocab()), d_model=64, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=32),
    transformer=dict(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm",
    ),
    vae=dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=256,
             latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
             use_post_quant_conv=False),
)

# Full size: stable-diffusion-3.5-medium's published component configs (random weights, for GPU
# speed runs; never build it in CPU tests): CLIP-L, OpenCLIP bigG, T5-XXL's encoder, the MMDiT-X
# transformer with dual attention in its first 13 layers, the 16-channel VAE.
FULL = dict(
    text=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu"),
    text_2=dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                num_attention_heads=20, projection_dim=1280, hidden_act="gelu"),
    text_3=dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128),
    transformer=dict(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    ),
    vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, sample_size=1024,
             latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
             use_post_quant_conv=False),
)

# Small: tiny's text encoders and VAE around a transformer wide and deep enough that its compute,
# not the step loop's overhead, dominates a CPU forward (8 heads of 64, 6 layers; SD3-medium's
# layout, no dual attention): what CPU benchmarks of the transformer's work (cached edits) serve.
SMALL = dict(TINY, transformer=dict(
    sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=64,
    num_attention_heads=8, joint_attention_dim=64, caption_projection_dim=512, pooled_projection_dim=64,
    pos_embed_max_size=64,
))

PRESETS = {"tiny": TINY, "small": SMALL, "full": FULL}


def build_preset_components(preset: str, seed: int, parts: Collection[str], device: torch.device,
                            dtype: torch.dtype) -> dict[str, Any]:
    """Random-weight components of the real classes, each seeded on its own (as SD1.5's)."""
    cfg = preset_config(PRESETS, preset, "sd3")
    out: dict[str, Any] = {"scheduler": FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER)}
    builders = {  # in seed order: SD1.5's parts, then the encoders built with TEXT
        TEXT: lambda: CLIPTextModelWithProjection(clip_text_config(cfg["text"])),
        DENOISER: lambda: SD3Transformer2DModel(**cfg["transformer"]),
        VAE: lambda: autoencoder_kl(cfg["vae"]),
        TEXT_2: lambda: CLIPTextModelWithProjection(clip_text_config(cfg["text_2"])),
        TEXT_3: lambda: t5_encoder(cfg["text_3"]),
    }
    wanted = set(parts) | ({TEXT_2, TEXT_3} if TEXT in parts else set())
    out.update(seeded_parts(builders, wanted, seed, preset, device, dtype))
    if TEXT in parts:
        out["tokenizer"] = out["tokenizer_2"] = byte_level_clip_tokenizer()
        out["tokenizer_3"] = character_t5_tokenizer(MAX_SEQUENCE_LENGTH)
    return {**out, **vae_geometry(cfg["vae"])}


# What a diffusers SD3 folder holds for each part: (component key, subfolder, class).
FOLDER_LAYOUT = {
    TEXT: (("tokenizer", "tokenizer", CLIPTokenizer), (TEXT, "text_encoder", CLIPTextModelWithProjection),
           ("tokenizer_2", "tokenizer_2", CLIPTokenizer), (TEXT_2, "text_encoder_2", CLIPTextModelWithProjection),
           # Real folders name T5TokenizerFast, which transformers 5 folds into T5Tokenizer.
           ("tokenizer_3", "tokenizer_3", T5Tokenizer), (TEXT_3, "text_encoder_3", T5EncoderModel)),
    DENOISER: ((DENOISER, "transformer", SD3Transformer2DModel),),
    VAE: sd15.FOLDER_LAYOUT[VAE],
}


def load_folder_components(path: str, parts: Collection[str]) -> dict[str, Any]:
    """Components from a local diffusers-format SD3 folder; safetensors only, never the hub."""
    return sd15.load_folder_components(path, parts, FOLDER_LAYOUT, StableDiffusion3Pipeline)


class SD3Family(FlowMatchingImageFamily):
    # An image family decoded in the VAE deployment, as SD1.5; the pipeline's `check_inputs`
    # refuses sides that are not multiples of the VAE's 8x times the transformer's patch of 2.
    modules = FlowMatchingImageFamily.modules + (TEXT_2, TEXT_3)
    edits = True  # as StableDiffusion3InpaintPipeline with this (16-channel) transformer
    forward_modes = frozenset({ModeName.PACKED, ModeName.TEMPLATE_EDIT, ModeName.PATCH_CACHE, ModeName.STEP_CACHE})

    def __init__(self, source: ModelSource, components: dict[str, Any], device: torch.device,
                 remote: RemoteControlNets | None = None):
        super().__init__(source, components, device, remote)
        if TEXT in components:
            # The T5 tokenizer's own length where it is shorter than the pipeline's 256 (the
            # shapes model's 16: its captions' words are one piece each; a real SD3 folder's is
            # 512); the golden references call the pipeline with it.
            self.max_sequence_length = min(components["tokenizer_3"].model_max_length, MAX_SEQUENCE_LENGTH)

    def make_pipeline(self, components: dict[str, Any], scheduler: Any) -> Any:
        return StableDiffusion3Pipeline(
            transformer=self.denoiser, scheduler=scheduler, vae=self.vae, text_encoder=components.get(TEXT),
            tokenizer=components.get("tokenizer"), text_encoder_2=components.get(TEXT_2),
            tokenizer_2=components.get("tokenizer_2"), text_encoder_3=components.get(TEXT_3),
            tokenizer_3=components.get("tokenizer_3"),
        )

    preset_components = staticmethod(build_preset_components)
    folder_components = staticmethod(load_folder_components)

    @classmethod
    def _configs(cls, source: ModelSource) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The transformer's and the VAE's configs, read without loading weights; None where they
        cannot be read here."""
        if source.preset is not None:
            if source.preset not in PRESETS:
                return None  # loading says which presets exist
            return PRESETS[source.preset]["transformer"], PRESETS[source.preset]["vae"]
        if os.path.isdir(source.path):
            return (SD3Transformer2DModel.load_config(source.path, subfolder="transformer"),
                    AutoencoderKL.load_config(source.path, subfolder="vae"))
        return None  # a folder only the workers' nodes hold

    @classmethod
    def max_side(cls, source: ModelSource) -> int | None:
        # The transformer's positional table covers `pos_embed_max_size` patches a side; beyond
        # that its forward raises.
        configs = cls._configs(source)
        if configs is None:
            return None
        transformer, vae = configs
        patches = transformer.get("pos_embed_max_size", 96) * transformer.get("patch_size", 2)
        return patches * vae_geometry(vae)["vae_scale_factor"]

    @classmethod
    def _text_tokens(cls, source: ModelSource) -> int:
        """The text tokens of its joint attention: the CLIP prompts padded to their tokenizer's
        length, then T5's `max_sequence_length` (as `__init__` sets it), read from a folder's
        tokenizer configs (the shapes model's 32 + 16); the presets' are SD3's 77 + 256."""
        clip, t5 = CLIP_TOKENS, MAX_SEQUENCE_LENGTH
        if source.preset is None and os.path.isdir(source.path):
            clip = _tokenizer_length(source.path, "tokenizer") or clip
            t5 = min(_tokenizer_length(source.path, "tokenizer_3") or t5, MAX_SEQUENCE_LENGTH)
        return clip + t5

    @classmethod
    def dit_dims(cls, source: ModelSource, kind: CacheKind) -> tuple[DiTDims, ...] | None:
        """The transformer as the edit cost model counts its FLOPs (`policies.instgenie.DiTDims`),
        with a cache of `kind`, read from configs without loading weights (the router prices edits
        with it); None where they cannot be read here. SD3.5's second, image-only attention in its
        first blocks is not counted: it scales with the masked tokens as the rest of its block
        does, so the latency line fitted to profiled forwards takes it into its slope."""
        configs = cls._configs(source)
        if configs is None:
            return None
        transformer, vae = configs
        return (DiTDims(blocks=transformer["num_layers"],
                        hidden=transformer["num_attention_heads"] * transformer["attention_head_dim"],
                        patch=transformer["patch_size"], text_tokens=cls._text_tokens(source),
                        latent_factor=vae_geometry(vae)["vae_scale_factor"],
                        bytes_per_value=source.torch_dtype.itemsize,
                        keys_values=CacheKind(kind) is CacheKind.KEYS_VALUES),)

    @torch.inference_mode()
    def encode_text(self, texts: Sequence[str]) -> TextEmbeddings:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            list(texts), None, None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"context": embeds, "pooled": pooled}

    def initial_latents(self, spec: RequestSpec, scheduler: Any, generator: torch.Generator) -> torch.Tensor:
        # As `StableDiffusion3Pipeline.prepare_latents`: plain noise (flow matching starts at sigma 1).
        shape = (1, self.latent_channels, spec.height // self.vae_scale_factor, spec.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)

    def prepare_scheduler(self, scheduler: Any, spec: RequestSpec) -> None:
        # As the pipeline: a dynamically shifting scheduler shifts by the image's token count.
        config, kwargs = scheduler.config, {}
        if config.get("use_dynamic_shifting", None):
            patch = self.denoiser.config.patch_size
            tokens = (spec.height // self.vae_scale_factor // patch) * (spec.width // self.vae_scale_factor // patch)
            kwargs["mu"] = calculate_shift(
                tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.16),
            )
        retrieve_timesteps(scheduler, spec.num_inference_steps, self.device, **kwargs)

    @torch.inference_mode()
    def denoise(
        self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning, sp_group: Any = None
    ) -> torch.Tensor:
        self.refuse_sequence_parallel(sp_group)
        return self.denoiser(hidden_states=sample, timestep=timesteps, encoder_hidden_states=cond["context"],
                             pooled_projections=cond["pooled"], return_dict=False)[0]

    def packs(self, sizes: Sequence[tuple[int, ...]]) -> bool:
        return True  # tokens of any sizes concatenate (each latent side is a multiple of the patch)

    @torch.inference_mode()
    def denoise_mixed(
        self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor, RowConditioning]]
    ) -> list[torch.Tensor]:
        """`denoise` of each (sample, timesteps, cond) of `inputs`, samples of any latent sizes, as
        one forward with their image tokens packed (`engine.packing.packed_sd3`), a piece per
        latent shape (`engine.packing.pieces`)."""
        return denoise_by_shape(inputs, lambda pieces: packed_forward(self.denoiser,
                                                                      [self._inputs(*piece) for piece in pieces]))

    # ---- template edits with cached activations (`engine.template_edits`) ------------------

    @property
    def patch_size(self) -> int:
        return self.denoiser.config.patch_size

    def cache_slots(self, kind: CacheKind) -> int:
        return cache_slots(self.denoiser, kind)

    def _inputs(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning) -> SD3Inputs:
        return SD3Inputs(sample, cond["context"], cond["pooled"], timesteps)

    def denoise_recording(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning,
                          kind: CacheKind) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`denoise`, and its record of `kind` (a template's activations at this step)."""
        return recording_forward(self.denoiser, self._inputs(sample, timesteps, cond), kind)

    def denoise_masked(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning,
                       plan: MaskedPlan) -> torch.Tensor:
        """`denoise` computing only `plan`'s masked tokens in the blocks it says, the rest cached."""
        return masked_forward(self.denoiser, self._inputs(sample, timesteps, cond), plan)

    def block_costs(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning, index: torch.Tensor,
                    cached: Sequence[torch.Tensor], kind: CacheKind, warmup: int, repeats: int) -> BlockCosts:
        """Each cache slot's measured costs in a masked forward of these inputs computing the tokens
        `index`, with `cached` its record of `kind` in host memory (`engine.editing.block_costs`)."""
        return measure_block_costs(self.denoiser, self._inputs(sample, timesteps, cond), index, cached, self.device,
                                   warmup, repeats, kind)

    # ---- reuse of a request's patches across steps (`engine.patch_cache`) ---------------------

    def denoise_patch_cached(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning,
                             caches: Sequence[PatchCache], reuse: PatchReuse) -> torch.Tensor:
        """`denoise` reusing each request's patches from its previous step where `reuse`'s
        predictor allows (`engine.patch_cache`); `caches`: the requests' own, rows in order."""
        return patch_cached_forward(self.denoiser, self._inputs(sample, timesteps, cond), caches, reuse)

    # ---- step caching (`engine.step_cache`) -------------------------------------------------

    @torch.inference_mode()
    def denoise_first_block_cached(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning,
                                   caches: Sequence[FirstBlockCache]) -> torch.Tensor:
        """`denoise` where each request's rows run the later blocks or reuse its cached residual,
        as its First-Block Cache decides; `caches`: the requests', rows in order."""
        return first_block_cached(split_sd3(self.denoiser, self._inputs(sample, timesteps, cond)), caches)


def _tokenizer_length(folder: str, subfolder: str) -> int | None:
    """The `model_max_length` a folder's tokenizer config gives, if it gives one (transformers
    writes a sentinel of 1e30 where a tokenizer has none)."""
    try:
        with open(os.path.join(folder, subfolder, "tokenizer_config.json")) as f:
            length = json.load(f).get("model_max_length")
    except FileNotFoundError:
        return None
    return int(length) if isinstance(length, (int, float)) and length < 1e6 else None
