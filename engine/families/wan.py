"""The Wan text-to-video families: UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan.

`WanFamily` ("wan") serves Wan 2.1 and Wan 2.2 T2V-A14B, whose pipeline hands the high-noise
steps to `transformer` and the low-noise ones to `transformer_2` (split at `boundary_ratio`);
both have Wan 2.1's VAE, so requests are validated alike. `WanTI2VFamily` ("wan-ti2v") serves
Wan 2.2 TI2V-5B: the Wan 2.2 VAE (48 latent channels, 16x spatial, so sides are multiples of 32,
which validation reads from the class) and a timestep per token (`expand_timesteps`).

As with SD1.5, a diffusers `WanPipeline` is built around whichever components this process
loaded and its own methods encode prompts, so the served result stays equal to the pipeline's.
The denoiser forward can run sequence-parallel over a process group the caller passes in
(`engine.parallel.ulysses`); the VAE always decodes on one worker.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, ClassVar, Collection, Mapping, Sequence

import diffusers
import numpy as np
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, is_accelerate_available
from diffusers.utils.torch_utils import randn_tensor
from safetensors.torch import load_file as load_safetensors
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from stepserve.engine.families.base import (
    ALL_PARTS, DENOISER, LOCAL, TEXT, VAE, DiffusionFamily, ModelSource, RowConditioning, TextEmbeddings,
    cast_module, folder_scheduler,
)
from stepserve.engine.families.presets import seeded_parts
from stepserve.engine.parallel.ulysses import UlyssesWanTransformer
from stepserve.engine.tokenizer import character_t5_tokenizer, t5_character_vocab
from stepserve.policies.types import RequestKind, RequestSpec

# Wan 2.1's published scheduler (UniPC on flow sigmas, shift 3.0 for 480p). UniPC is multistep:
# it keeps a history of model outputs, which paused videos carry with them.
WAN_SCHEDULER = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", solver_order=2,
    prediction_type="flow_prediction", predict_x0=True, solver_type="bh2", lower_order_final=True,
    use_flow_sigmas=True, flow_shift=3.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
)

# Tiny: the same classes, small widths. Eight heads so Ulysses can split them over up to 8 ranks;
# the VAE keeps Wan's 4x temporal / 8x spatial compression and 16 latent channels (so the default
# latents_mean/std apply).
TINY = dict(
    text=dict(
        vocab_size=len(t5_character_vocab()), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
    ),
    transformer=dict(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    ),
    vae=dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]),
    max_sequence_length=32,
    scheduler=WAN_SCHEDULER,
)

# Full size: Wan2.1-T2V-1.3B's transformer, umt5-xxl's encoder, Wan 2.1's VAE (random weights,
# for GPU speed runs; never build it in CPU tests).
FULL = dict(
    text=dict(
        vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
    ),
    transformer=dict(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    ),
    vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]),
    max_sequence_length=512,
    scheduler=WAN_SCHEDULER,
)

# Wan 2.2 T2V-A14B: two transformers of one architecture, `transformer` for the high-noise steps
# (t >= boundary_ratio * 1000) and `transformer_2` for the rest; Wan 2.1's VAE and scheduler.
# Sizes, boundary and flow shift as diffusers' scripts/convert_wan_to_diffusers.py writes
# Wan-AI/Wan2.2-T2V-A14B-Diffusers (that script is not shipped in the wheel).
A14B_BOUNDARY_RATIO = 0.875
A14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
TINY_A14B = dict(TINY, transformer_2=TINY["transformer"], boundary_ratio=A14B_BOUNDARY_RATIO)
FULL_A14B = dict(
    FULL, transformer=A14B_TRANSFORMER, transformer_2=A14B_TRANSFORMER, boundary_ratio=A14B_BOUNDARY_RATIO,
)

# Wan 2.2 TI2V-5B: the Wan 2.2 VAE (4x temporal; 2x2 pixel patches then 8x spatial, so 16x; 48
# latent channels with their own mean/std) and a 48-channel transformer, timesteps per token,
# the same UniPC with flow shift 5.0. Values from the same conversion script.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]
WAN22_VAE_LAYOUT = dict(
    z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4,
    scale_factor_spatial=16, temperal_downsample=[False, True, True], latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
)
TI2V_SCHEDULER = dict(WAN_SCHEDULER, flow_shift=5.0)
# Tiny: Wan 2.2's VAE layout at small widths (the decoder wider than the encoder, as published).
TINY_TI2V = dict(
    TINY,
    transformer=dict(TINY["transformer"], in_channels=48, out_channels=48),
    vae=dict(WAN22_VAE_LAYOUT, base_dim=8, decoder_base_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    scheduler=TI2V_SCHEDULER,
    expand_timesteps=True,
)
FULL_TI2V = dict(
    FULL,
    transformer=dict(
        patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
        text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    ),
    vae=dict(WAN22_VAE_LAYOUT, base_dim=160, decoder_base_dim=256, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
    scheduler=TI2V_SCHEDULER,
    expand_timesteps=True,
)

PRESETS = {"tiny": TINY, "full": FULL, "tiny-a14b": TINY_A14B, "full-a14b": FULL_A14B}
TI2V_PRESETS = {"tiny": TINY_TI2V, "full": FULL_TI2V}
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default
TRANSFORMER_2 = "transformer_2"  # A14B's low-noise transformer, loaded with DENOISER


def _text_encoder(cfg: dict) -> UMT5EncoderModel:
    config = UMT5Config(feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **cfg)
    return UMT5EncoderModel(config)


def _vae_scale_factors(vae_config: dict) -> tuple[int, int]:
    """(temporal, spatial) compression, read as the pipeline reads them."""
    return int(vae_config.get("scale_factor_temporal") or 4), int(vae_config.get("scale_factor_spatial") or 8)


def build_preset_components(preset: str, seed: int, parts: Collection[str], device: torch.device,
                            presets: Mapping[str, dict] = PRESETS,
                            dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Random-weight components of the real classes, each seeded on its own and full presets
    built in the serving dtype (`presets.seeded_parts`); Wan 2.2 A14B's second transformer is
    loaded with the DENOISER part."""
    if preset not in presets:
        raise ValueError(f"unknown wan preset {preset!r}; known: {sorted(presets)}")
    cfg = presets[preset]
    out: dict[str, Any] = {"scheduler": UniPCMultistepScheduler(**cfg["scheduler"])}
    builders = {  # in seed order: Wan 2.1's parts keep their seeds
        TEXT: lambda: _text_encoder(cfg["text"]),
        DENOISER: lambda: WanTransformer3DModel(**cfg["transformer"]),
        VAE: lambda: AutoencoderKLWan(**cfg["vae"]),
    }
    if TRANSFORMER_2 in cfg:
        builders[TRANSFORMER_2] = lambda: WanTransformer3DModel(**cfg[TRANSFORMER_2])
    wanted = set(parts) | ({TRANSFORMER_2} if DENOISER in parts else set())
    # The VAE runs in float32 whatever the serving dtype (see WanFamily.__init__).
    out.update(seeded_parts(builders, wanted, seed, preset, device, dtype, float32_parts={VAE}))
    if TEXT in parts:
        out["tokenizer"] = character_t5_tokenizer(cfg["max_sequence_length"])
    out["vae_scale_factors"] = _vae_scale_factors(cfg["vae"])
    out["latent_channels"] = cfg["transformer"]["in_channels"]
    out["max_sequence_length"] = cfg["max_sequence_length"]
    out["boundary_ratio"] = cfg.get("boundary_ratio")
    out["expand_timesteps"] = cfg.get("expand_timesteps", False)
    return out


def _load_diffusers_model(cls: Any, path: str, subfolder: str) -> Any:
    """`cls.from_pretrained` from safetensors; by hand where diffusers cannot.

    Without `accelerate`, diffusers refuses to load classes that keep modules in float32
    (`WanTransformer3DModel` does); `accelerate` is not a stepserve dependency, so then the
    config and the safetensors shards are read directly. Either way `.bin` weights are refused.
    """
    if is_accelerate_available() or not getattr(cls, "_keep_in_fp32_modules", None):
        return cls.from_pretrained(path, subfolder=subfolder, use_safetensors=True, local_files_only=True)
    folder = os.path.join(path, subfolder)
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, SAFETENSORS_WEIGHTS_NAME)):
        files = [SAFETENSORS_WEIGHTS_NAME]
    else:
        raise OSError(f"{folder!r} has no {SAFETENSORS_WEIGHTS_NAME} (only .safetensors weights are loaded)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_safetensors(os.path.join(folder, name)))
    ignored = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    state = {k: v for k, v in state.items() if not any(re.search(p, k) for p in ignored)}
    model = cls.from_config(cls.load_config(folder))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder!r}: weights do not match {cls.__name__}: missing {missing}, unexpected {unexpected}")
    return model


def load_folder_components(path: str, parts: Collection[str]) -> dict[str, Any]:
    """Components from a local diffusers-format Wan folder; safetensors only, never the hub.
    Its model_index says which Wan it is: Wan 2.2 A14B names a `transformer_2` and a
    `boundary_ratio`, TI2V-5B sets `expand_timesteps`."""
    out: dict[str, Any] = {"scheduler": folder_scheduler(path, WanPipeline)}
    index = WanPipeline.load_config(path)
    two_transformers = (index.get(TRANSFORMER_2) or [None, None])[1] is not None
    boundary_ratio = index.get("boundary_ratio")
    # The pipeline would ignore a second transformer without a boundary, and fail at the first
    # low-noise step with a boundary but no second transformer.
    if two_transformers != (boundary_ratio is not None):
        raise ValueError(f"{path!r}: model_index.json has {'a' if two_transformers else 'no'} transformer_2 "
                         f"but boundary_ratio {boundary_ratio}; Wan 2.2 A14B needs both")
    if TEXT in parts:
        # AutoTokenizer: real Wan folders name T5TokenizerFast, which transformers 5 maps to T5Tokenizer.
        out["tokenizer"] = AutoTokenizer.from_pretrained(path, subfolder="tokenizer", local_files_only=True)
        out[TEXT] = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", **LOCAL)
    if DENOISER in parts:
        out[DENOISER] = _load_diffusers_model(WanTransformer3DModel, path, "transformer")
        if two_transformers:
            out[TRANSFORMER_2] = _load_diffusers_model(WanTransformer3DModel, path, TRANSFORMER_2)
    if VAE in parts:
        out[VAE] = AutoencoderKLWan.from_pretrained(path, subfolder="vae", **LOCAL)
    out["vae_scale_factors"] = _vae_scale_factors(AutoencoderKLWan.load_config(path, subfolder="vae"))
    out["latent_channels"] = WanTransformer3DModel.load_config(path, subfolder="transformer")["in_channels"]
    out["max_sequence_length"] = DEFAULT_MAX_SEQUENCE_LENGTH
    out["boundary_ratio"] = boundary_ratio
    out["expand_timesteps"] = bool(index.get("expand_timesteps", False))
    return out


class WanFamily(DiffusionFamily):
    """Weights and stateless helpers; per-video state lives in `engine.sampler.Sampler`."""

    kind = RequestKind.T2V
    # `WanPipeline.check_inputs` refuses sides not divisible by 16 (VAE 8x times patch 2) and
    # rounds frames to 4k+1 (the VAE's 4x temporal compression); `__init__` checks the weights agree.
    size_multiple = 16
    frame_step = 4
    sequence_parallel = True
    decode_on_worker = True  # a video's latents are already on its worker, and decode is one call
    # Whether its pipeline gives every token its own timestep (`WanPipeline(expand_timesteps=...)`);
    # a folder's model_index must agree, as its VAE must agree with `size_multiple`.
    expand_timesteps: ClassVar[bool] = False
    presets: ClassVar[Mapping[str, dict]] = PRESETS

    def __init__(self, source: ModelSource, components: dict[str, Any], device: torch.device):
        self.source = source
        self.device = device
        self.dtype = source.torch_dtype
        if components["expand_timesteps"] != self.expand_timesteps:
            right = "wan-ti2v" if components["expand_timesteps"] else "wan"
            raise ValueError(f"model {source.name!r}: its pipeline has expand_timesteps="
                             f"{components['expand_timesteps']}; serve it as family {right!r}")
        for key in (TEXT, DENOISER, TRANSFORMER_2, VAE):
            if key in components:
                module = components[key].to(device).eval().requires_grad_(False)
                # Wan's VAE runs in float32 whatever the serving dtype (as diffusers' Wan examples
                # load it): its causal 3D convolutions are unstable in half precision.
                cast_module(module, torch.float32 if key == VAE else self.dtype)
        scheduler = components["scheduler"]
        if source.scheduler is not None:
            scheduler_cls = getattr(diffusers, source.scheduler, None)
            if scheduler_cls is None or not hasattr(scheduler_cls, "from_config"):
                raise ValueError(f"model {source.name!r}: unknown scheduler {source.scheduler!r}")
            scheduler = scheduler_cls.from_config(scheduler.config)
        self.transformer = components.get(DENOISER)
        self.transformer_2 = components.get(TRANSFORMER_2)
        self.boundary_ratio = components["boundary_ratio"]
        # The pipeline's switch point: `transformer` at t >= it, `transformer_2` below.
        self.boundary_timestep = (None if self.boundary_ratio is None
                                  else self.boundary_ratio * scheduler.config.num_train_timesteps)
        self.vae = components.get(VAE)
        self.vae_scale_factor_temporal, self.vae_scale_factor = components["vae_scale_factors"]
        if self.vae_scale_factor_temporal != self.frame_step:
            raise ValueError(f"model {source.name!r}: VAE temporal compression {self.vae_scale_factor_temporal}, "
                             f"but the wan family serves {self.frame_step}x")
        if self.transformer is not None:
            patch = self.transformer.config.patch_size[1]
            if self.vae_scale_factor * patch != self.size_multiple:
                raise ValueError(f"model {source.name!r}: VAE {self.vae_scale_factor}x times patch {patch} is not "
                                 f"the wan family's size multiple {self.size_multiple}")
        self.latent_channels = components["latent_channels"]
        self.max_sequence_length = components["max_sequence_length"]
        # The pipeline object is only a holder for diffusers' own helper methods (and the
        # reference the golden tests compare against).
        self.pipe = WanPipeline(
            tokenizer=components.get("tokenizer"), text_encoder=components.get(TEXT), vae=self.vae,
            scheduler=scheduler, transformer=self.transformer, transformer_2=self.transformer_2,
            boundary_ratio=self.boundary_ratio, expand_timesteps=self.expand_timesteps,
        )
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def load(cls, source: ModelSource, parts: Collection[str], device: str | torch.device) -> "WanFamily":
        unknown = set(parts) - ALL_PARTS
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}")
        device = torch.device(device)
        if source.preset is not None:
            components = build_preset_components(source.preset, source.seed, parts, device, cls.presets,
                                                 source.torch_dtype)
        else:
            components = load_folder_components(source.path, parts)
        return cls(source, components, device)

    # ---- shapes -------------------------------------------------------------------------

    def video_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        """(height, width, frames) as `WanPipeline.__call__` would actually generate them: sides
        must be multiples of `size_multiple`, and frames are rounded to 4k+1."""
        if height % self.size_multiple or width % self.size_multiple:
            raise ValueError(f"height and width must be divisible by {self.size_multiple}, got {height}x{width}")
        t = self.frame_step
        if num_frames % t != 1:
            num_frames = num_frames // t * t + 1
        return height, width, max(num_frames, 1)

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int, int, int]:
        frames = (num_frames - 1) // self.vae_scale_factor_temporal + 1
        return (1, self.latent_channels, frames, height // self.vae_scale_factor, width // self.vae_scale_factor)

    # ---- the DiffusionFamily interface --------------------------------------------------

    @torch.inference_mode()
    def encode_text(self, texts: Sequence[str]) -> TextEmbeddings:
        """"context" [len(texts), max_sequence_length, dim]: each prompt's tokens, zero-padded (as
        the pipeline does, so a text's embedding does not depend on its batch mates)."""
        embeds, _ = self.pipe.encode_prompt(
            list(texts), do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"context": embeds}

    def make_scheduler(self) -> Any:
        return type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)

    def initial_latents(self, spec: RequestSpec, scheduler: Any, generator: torch.Generator) -> torch.Tensor:
        # As `WanPipeline.prepare_latents`: float32 noise whatever the transformer's dtype, for
        # the shape the pipeline generates (frames rounded to 4k+1).
        shape = self.latent_shape(*self.video_shape(spec.height, spec.width, spec.num_frames))
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    def prepare_scheduler(self, scheduler: Any, spec: RequestSpec) -> None:
        super().prepare_scheduler(scheduler, spec)
        # As the pipeline: count steps from 0 instead of looking timesteps up.
        scheduler.set_begin_index(0)

    def scale_model_input(self, scheduler: Any, sample: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return sample  # the pipeline feeds the latents as they are

    def step_kwargs(self, scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
        return {}  # the pipeline passes none

    @torch.inference_mode()
    def denoise(
        self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning, sp_group: Any = None
    ) -> torch.Tensor:
        """One forward; with `sp_group` (a torch.distributed group) every rank of the group
        passes the same inputs and gets the same full output, the token sequence split among them.

        Wan 2.2 A14B: as the pipeline, rows at t >= the boundary go through `transformer` (high
        noise) and the others through `transformer_2`. Requests at different steps share a
        forward, so one batch may hold both kinds: each transformer runs on its own rows and the
        outputs go back in row order. (The pipeline's `guidance_scale_2` for the low-noise steps
        defaults to `guidance_scale`; a request has one guidance scale, which the sampler applies
        on both sides alike.)
        """
        sample, context = sample.to(self.transformer.dtype), cond["context"]
        if self.boundary_timestep is None:
            return self._forward(self.transformer, sample, timesteps, context, sp_group)
        high = timesteps >= self.boundary_timestep
        if high.all():
            return self._forward(self.transformer, sample, timesteps, context, sp_group)
        if not high.any():
            return self._forward(self.transformer_2, sample, timesteps, context, sp_group)
        parts = ((high, self.transformer), (~high, self.transformer_2))
        outputs = [self._forward(model, sample[rows], timesteps[rows], context[rows], sp_group)
                   for rows, model in parts]
        # Back in row order: the inverse of the permutation that put the high-noise rows first.
        order = torch.cat([rows.nonzero() for rows, _ in parts]).squeeze(1).argsort()
        return torch.cat(outputs)[order]

    def _forward(self, model: WanTransformer3DModel, sample: torch.Tensor, timesteps: torch.Tensor,
                 context: torch.Tensor, sp_group: Any) -> torch.Tensor:
        if self.expand_timesteps:
            timesteps = self._per_token(model, sample, timesteps)
        if sp_group is None:
            return model(hidden_states=sample, timestep=timesteps, encoder_hidden_states=context, return_dict=False)[0]
        return UlyssesWanTransformer(model, sp_group)(hidden_states=sample, timestep=timesteps,
                                                      encoder_hidden_states=context)

    @staticmethod
    def _per_token(model: WanTransformer3DModel, sample: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """[rows] → [rows, tokens], as `WanPipeline` with `expand_timesteps` builds it: its float32
        mask (all ones for text-to-video) times t, a row's own t on each of its tokens."""
        _, _, frames, height, width = sample.shape
        p_t, p_h, p_w = model.config.patch_size
        mask = torch.ones((frames // p_t) * (height // p_h) * (width // p_w), dtype=torch.float32, device=sample.device)
        return mask * timesteps[:, None]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, f, h, w] → float video [B, F, H, W, 3] in [0, 1], as the pipeline decodes."""
        latents = latents.to(self.vae.device, dtype=self.vae.dtype)
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        # The pipeline's arithmetic, in its order: divide by the reciprocal std, add the mean.
        latents_mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = latents / latents_std + latents_mean
        video = self.vae.decode(latents, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="np")


class WanTI2VFamily(WanFamily):
    """Wan 2.2 TI2V-5B, text to video: one 48-channel transformer over the Wan 2.2 VAE's latents,
    a timestep per token. A family of its own because validation reads `size_multiple` from the
    class, before any weights exist."""

    # VAE 16x times patch 2. `WanPipeline.check_inputs` accepts multiples of 16, but `__call__`
    # then rounds sides down to multiples of 32 with a warning; serving refuses them instead, so
    # a video comes out the size it was asked for.
    size_multiple = 32
    expand_timesteps = True
    presets = TI2V_PRESETS
