"""The Wan 2.1 text-to-video family: UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan.

As with SD1.5, a diffusers `WanPipeline` is built around whichever components this process
loaded and its own methods encode prompts, so the served result stays equal to the pipeline's.
The denoiser forward can run sequence-parallel over a process group the caller passes in
(`engine.parallel.ulysses`); the VAE always decodes on one worker.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Collection, Sequence

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
    folder_scheduler,
)
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
)

PRESETS = {"tiny": TINY, "full": FULL}
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default


def _text_encoder(cfg: dict) -> UMT5EncoderModel:
    config = UMT5Config(feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **cfg)
    return UMT5EncoderModel(config)


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to `dtype` but leave what the model class marks `_keep_in_fp32_modules` at its own
    precision, as `from_pretrained(torch_dtype=...)` does (Wan: rope, time embedder, modulation
    tables; UMT5: the feed-forward output)."""
    if module.dtype == dtype:
        return
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    kept = {}
    if dtype in (torch.float16, torch.bfloat16):
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_floating_point() and any(k in name.split(".") for k in keep):
                kept[name] = tensor.data
    module.to(dtype=dtype)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in kept:
            tensor.data = kept[name]


def _vae_scale_factors(vae_config: dict) -> tuple[int, int]:
    """(temporal, spatial) compression, read as the pipeline reads them."""
    return int(vae_config.get("scale_factor_temporal") or 4), int(vae_config.get("scale_factor_spatial") or 8)


def build_preset_components(preset: str, seed: int, parts: Collection[str], device: torch.device) -> dict[str, Any]:
    """Random-weight components of the real classes, each seeded on its own so a process that
    builds only the transformer gets the same transformer as one that builds everything.

    The full preset is built directly on a CUDA device (initialising billions of weights on the
    host is slow); its weights are then deterministic per seed and device type.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown wan preset {preset!r}; known: {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    build_on = device if (preset == "full" and device.type == "cuda") else torch.device("cpu")
    out: dict[str, Any] = {"scheduler": UniPCMultistepScheduler(**WAN_SCHEDULER)}
    builders = {
        TEXT: lambda: _text_encoder(cfg["text"]),
        DENOISER: lambda: WanTransformer3DModel(**cfg["transformer"]),
        VAE: lambda: AutoencoderKLWan(**cfg["vae"]),
    }
    for offset, part in enumerate((TEXT, DENOISER, VAE)):
        if part in parts:
            torch.manual_seed(seed * 1009 + offset)
            with build_on:
                out[part] = builders[part]()
    if TEXT in parts:
        out["tokenizer"] = character_t5_tokenizer(cfg["max_sequence_length"])
    out["vae_scale_factors"] = _vae_scale_factors(cfg["vae"])
    out["latent_channels"] = cfg["transformer"]["in_channels"]
    out["max_sequence_length"] = cfg["max_sequence_length"]
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
    """Components from a local diffusers-format Wan folder; safetensors only, never the hub."""
    out: dict[str, Any] = {"scheduler": folder_scheduler(path, WanPipeline)}
    if TEXT in parts:
        # AutoTokenizer: real Wan folders name T5TokenizerFast, which transformers 5 maps to T5Tokenizer.
        out["tokenizer"] = AutoTokenizer.from_pretrained(path, subfolder="tokenizer", local_files_only=True)
        out[TEXT] = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", **LOCAL)
    if DENOISER in parts:
        out[DENOISER] = _load_diffusers_model(WanTransformer3DModel, path, "transformer")
    if VAE in parts:
        out[VAE] = AutoencoderKLWan.from_pretrained(path, subfolder="vae", **LOCAL)
    out["vae_scale_factors"] = _vae_scale_factors(AutoencoderKLWan.load_config(path, subfolder="vae"))
    out["latent_channels"] = WanTransformer3DModel.load_config(path, subfolder="transformer")["in_channels"]
    out["max_sequence_length"] = DEFAULT_MAX_SEQUENCE_LENGTH
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

    def __init__(self, source: ModelSource, components: dict[str, Any], device: torch.device):
        self.source = source
        self.device = device
        self.dtype = source.torch_dtype
        for part in (TEXT, DENOISER, VAE):
            if part in components:
                module = components[part].to(device).eval().requires_grad_(False)
                # Wan's VAE runs in float32 whatever the serving dtype (as diffusers' Wan examples
                # load it): its causal 3D convolutions are unstable in half precision.
                _cast(module, torch.float32 if part == VAE else self.dtype)
        scheduler = components["scheduler"]
        if source.scheduler is not None:
            scheduler_cls = getattr(diffusers, source.scheduler, None)
            if scheduler_cls is None or not hasattr(scheduler_cls, "from_config"):
                raise ValueError(f"model {source.name!r}: unknown scheduler {source.scheduler!r}")
            scheduler = scheduler_cls.from_config(scheduler.config)
        self.transformer = components.get(DENOISER)
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
            scheduler=scheduler, transformer=self.transformer,
        )
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def load(cls, source: ModelSource, parts: Collection[str], device: str | torch.device) -> "WanFamily":
        unknown = set(parts) - ALL_PARTS
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}")
        device = torch.device(device)
        if source.preset is not None:
            components = build_preset_components(source.preset, source.seed, parts, device)
        else:
            components = load_folder_components(source.path, parts)
        return cls(source, components, device)

    # ---- shapes -------------------------------------------------------------------------

    def video_shape(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        """(height, width, frames) as `WanPipeline.__call__` would actually generate them: it
        rejects sizes not divisible by 16 and rounds frames to 4k+1."""
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

    def prepare_scheduler(self, scheduler: Any, num_inference_steps: int) -> None:
        super().prepare_scheduler(scheduler, num_inference_steps)
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
        passes the same inputs and gets the same full output, the token sequence split among them."""
        sample, context = sample.to(self.transformer.dtype), cond["context"]
        if sp_group is None:
            return self.transformer(
                hidden_states=sample, timestep=timesteps, encoder_hidden_states=context, return_dict=False
            )[0]
        sp = UlyssesWanTransformer(self.transformer, sp_group)
        return sp(hidden_states=sample, timestep=timesteps, encoder_hidden_states=context)

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
