"""The Stable Diffusion 1.x family: CLIP text encoder, UNet2DConditionModel, AutoencoderKL.

The diffusers `StableDiffusionPipeline` is built around whichever components this process
loaded and its own methods do the encoding, noise preparation and post-processing, so the
served result stays equal to the pipeline's.
"""

from __future__ import annotations

import importlib.util
import functools
from dataclasses import replace
from typing import Any, Callable, ClassVar, Collection, Sequence

import diffusers
import numpy as np
import torch
from diffusers import (
    AutoencoderKL, ControlNetModel, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel,
)
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer, PreTrainedTokenizerBase

from stepserve.engine.addons import StepAddons
from stepserve.engine.addons.controlnet import (
    ControlNetService, RemoteControlNets, Residuals, active_uses, by_controlnet, control_residuals, sum_residuals,
)
from stepserve.engine.addons.overlap import late_residuals
from stepserve.engine.addons.lora import LoraWeights, lora_rows
from stepserve.engine.families.base import (
    ALL_PARTS, DENOISER, LOCAL, TEXT, VAE, DiffusionFamily, ModelSource, RowConditioning, TextEmbeddings,
    cast_module, folder_scheduler,
)
from stepserve.engine.families.presets import (
    autoencoder_kl, clip_text_config, preset_config, seeded_parts, vae_geometry,
)
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.patched.layout import patch_side
from stepserve.engine.patched.unet import patch_multiple, patched_unet_forward
from stepserve.engine.step_cache.first_block import FirstBlockCache, first_block_cached
from stepserve.engine.step_cache.split_unet import split_unet
from stepserve.engine.tokenizer import byte_level_clip_tokenizer, byte_level_vocab
from stepserve.engine.vae_chunking import ChunkedDecode
from stepserve.policies.types import RequestKind, RequestSpec

# SD1.5's noise schedule; presets step it with Euler (steps == num_inference_steps exactly).
SD_SCHEDULER = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
    steps_offset=1, timestep_spacing="leading",
)

# Tiny: same classes, small widths. The VAE keeps four blocks so the 8x downscale matches SD.
TINY = dict(
    text=dict(
        vocab_size=len(byte_level_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4,
    ),
    unet=dict(
        sample_size=32, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    ),
    vae=dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=256),
)

# Full size: the published SD1.5 component configs (random weights, for GPU speed runs).
FULL = dict(
    text=dict(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        projection_dim=768, hidden_act="quick_gelu",
    ),
    unet=dict(
        sample_size=64, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
    ),
    vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, sample_size=512),
)

PRESETS = {"tiny": TINY, "full": FULL}


def build_preset_components(preset: str, seed: int, parts: Collection[str], device: torch.device,
                            dtype: torch.dtype) -> dict[str, Any]:
    """Random-weight components of the real classes. Each component is seeded on its own so a
    process that builds only the UNet gets the same UNet as one that builds everything."""
    cfg = preset_config(PRESETS, preset, "sd15")
    out: dict[str, Any] = {"scheduler": EulerDiscreteScheduler(**SD_SCHEDULER)}
    builders = {
        TEXT: lambda: CLIPTextModel(clip_text_config(cfg["text"])),
        DENOISER: lambda: UNet2DConditionModel(in_channels=4, out_channels=4, **cfg["unet"]),
        VAE: lambda: autoencoder_kl(cfg["vae"]),
    }
    out.update(seeded_parts(builders, parts, seed, preset, device, dtype))
    if TEXT in parts:
        out["tokenizer"] = byte_level_clip_tokenizer()
    return {**out, **vae_geometry(cfg["vae"])}


# What a diffusers SD folder holds for each part: (component key, subfolder, class).
FOLDER_LAYOUT = {
    TEXT: (("tokenizer", "tokenizer", CLIPTokenizer), (TEXT, "text_encoder", CLIPTextModel)),
    DENOISER: ((DENOISER, "unet", UNet2DConditionModel),),
    VAE: ((VAE, "vae", AutoencoderKL),),
}


def load_folder_components(path: str, parts: Collection[str], layout: dict[str, tuple] = FOLDER_LAYOUT,
                           pipeline_cls: Any = StableDiffusionPipeline) -> dict[str, Any]:
    """Components from a local diffusers-format folder; safetensors only, never the hub."""
    out: dict[str, Any] = {"scheduler": folder_scheduler(path, pipeline_cls)}
    for part in parts:
        for key, subfolder, cls in layout[part]:
            # Tokenizers have no weights: only their files, from the folder.
            local = dict(local_files_only=True) if issubclass(cls, PreTrainedTokenizerBase) else LOCAL
            out[key] = cls.from_pretrained(path, subfolder=subfolder, **local)
    return {**out, **vae_geometry(AutoencoderKL.load_config(path, subfolder="vae"))}


class SD15Family(DiffusionFamily):
    kind = RequestKind.T2I
    size_multiple = 8  # `StableDiffusionPipeline.check_inputs` refuses other sides
    frame_step = 1
    sequence_parallel = False
    decode_on_worker = False  # images decode in the VAE deployment, off the step loop
    # The component keys that hold torch modules (a family with more text encoders adds theirs).
    modules: ClassVar[tuple[str, ...]] = (TEXT, DENOISER, VAE)
    # xformers attention on CUDA where installed (an optional extra): for UNets; DiTs use SDPA.
    xformers_attention: ClassVar[bool] = True
    takes_addons = True
    edits = True  # as StableDiffusionInpaintPipeline with this (4-channel) UNet
    # Packed: a patched UNet forward (`engine.patched`), exact. Step cache: the UNet cut after
    # its first down block (`engine.step_cache.split_unet`).
    forward_modes = frozenset({ModeName.PACKED, ModeName.STEP_CACHE})

    def __init__(self, source: ModelSource, components: dict[str, Any], device: torch.device,
                 remote: RemoteControlNets | None = None):
        self.source = source
        self.device = device
        self.dtype = source.torch_dtype
        for key in self.modules:
            if key in components:
                cast_module(components[key].to(device).eval().requires_grad_(False), self.dtype)
        scheduler = components["scheduler"]
        if source.scheduler is not None:
            scheduler_cls = getattr(diffusers, source.scheduler, None)
            if scheduler_cls is None or not hasattr(scheduler_cls, "from_config"):
                raise ValueError(f"model {source.name!r}: unknown scheduler {source.scheduler!r}")
            scheduler = scheduler_cls.from_config(scheduler.config)
        self.denoiser = components.get(DENOISER)
        self.vae = components.get(VAE)
        self.controlnets: dict[str, ControlNetModel] = {}
        # Where the ControlNets run when not here (SwiftDiffusion's ControlNet-as-a-Service).
        self.controlnet_service: ControlNetService | None = None if remote is None else remote.service
        self.loras: dict[str, LoraWeights] = {}
        if self.denoiser is not None and device.type == "cuda" and self.xformers_attention \
                and importlib.util.find_spec("xformers"):
            self.denoiser.enable_xformers_memory_efficient_attention()
        self.vae_scale_factor = components["vae_scale_factor"]
        self.latent_channels = components["latent_channels"]
        # The pipeline object is only a holder for diffusers' own helper methods.
        self.pipe = self.make_pipeline(components, scheduler)
        self.pipe.set_progress_bar_config(disable=True)

    def make_pipeline(self, components: dict[str, Any], scheduler: Any) -> Any:
        return StableDiffusionPipeline(
            vae=self.vae, text_encoder=components.get(TEXT), tokenizer=components.get("tokenizer"),
            unet=self.denoiser, scheduler=scheduler, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )

    @classmethod
    def load(cls, source: ModelSource, parts: Collection[str], device: str | torch.device,
             remote: RemoteControlNets | None = None) -> "SD15Family":
        """`remote`: where its ControlNets run, when not on this worker."""
        unknown = set(parts) - ALL_PARTS
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}")
        device = torch.device(device)
        if source.preset is not None:
            components = cls.preset_components(source.preset, source.seed, parts, device, source.torch_dtype)
        else:
            components = cls.folder_components(source.path, parts)
        return cls(source, components, device, remote)

    # Where `load` gets its components; a family built on this one names its own.
    preset_components = staticmethod(build_preset_components)
    folder_components = staticmethod(load_folder_components)

    @torch.inference_mode()
    def encode_text(self, texts: Sequence[str]) -> TextEmbeddings:
        embeds, _ = self.pipe.encode_prompt(list(texts), self.device, 1, False)
        return {"context": embeds}

    def make_scheduler(self) -> Any:
        return type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)

    def initial_latents(self, spec: RequestSpec, scheduler: Any, generator: torch.Generator) -> torch.Tensor:
        # `StableDiffusionPipeline.prepare_latents` reads the pipeline's shared scheduler; the
        # per-request scheduler's `init_noise_sigma` depends on its own timesteps, so inline it.
        shape = (1, self.latent_channels, spec.height // self.vae_scale_factor, spec.width // self.vae_scale_factor)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return latents * scheduler.init_noise_sigma

    @torch.inference_mode()
    def encode_image(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = self.vae.encode(pixels.to(device=self.device, dtype=self.dtype)).latent_dist
        return dist.mean, dist.std

    def image_latents(self, sample: torch.Tensor) -> torch.Tensor:
        return self.vae.config.scaling_factor * sample

    def noise_image(self, scheduler: Any, image_latents: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor) -> torch.Tensor:
        return scheduler.add_noise(image_latents, noise, t)

    def refuse_sequence_parallel(self, sp_group: Any) -> None:
        """These families declare `sequence_parallel = False`, so the step runner never passes a
        group; one that comes anyway is an error, not a silent single-process forward."""
        if sp_group is not None:
            raise ValueError(f"model {self.source.name!r} ({self.source.family}) cannot run sequence-parallel")

    def add_controlnet(self, name: str, controlnet: ControlNetModel) -> None:
        """Serve `controlnet` as `name` on this family's device and dtype."""
        if controlnet.config.global_pool_conditions:
            raise ValueError(f"ControlNet {name!r} pools its conditions (guess mode only); not served")
        cast_module(controlnet.to(self.device).eval().requires_grad_(False), self.dtype)
        self.controlnets[name] = controlnet

    def add_lora(self, lora: LoraWeights) -> None:
        """Serve `lora` by its name; its layers must be this family's denoiser's."""
        missing = [m for m in lora.layers if not _has_submodule(self.denoiser, m)]
        if missing:
            raise ValueError(f"LoRA {lora.name!r} targets layers the denoiser does not have: {missing[:3]}")
        self.loras[lora.name] = lora.to(self.device, self.dtype)

    def remove_lora(self, name: str) -> None:
        self.loras.pop(name, None)

    def denoiser_inputs(self, cond: RowConditioning) -> dict[str, Any]:
        """The UNet's (and its ControlNets') per-row inputs besides sample and timestep."""
        return {"encoder_hidden_states": cond["context"]}

    @torch.inference_mode()
    def denoise(
        self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning, sp_group: Any = None,
        addons: StepAddons | None = None,
    ) -> torch.Tensor:
        self.refuse_sequence_parallel(sp_group)
        inputs = self.denoiser_inputs(cond)
        addons = addons or StepAddons()
        with lora_rows(self.denoiser, self.loras, addons.loras, batch=sample.shape[0]):
            if self.controlnet_service is not None and active_uses(addons.controls):
                # The ControlNets run in the service while the UNet's encoder half runs here.
                with late_residuals(self.denoiser, self._service_residuals(sample, timesteps, inputs, addons)):
                    return self.denoiser(sample, timesteps, **inputs, return_dict=False)[0]
            # Here, before the UNet, as the diffusers pipelines run them.
            residuals = control_residuals(self.controlnets, sample, timesteps, inputs, addons.controls)
            if residuals is not None:
                inputs = {**inputs, "down_block_additional_residuals": residuals[0],
                          "mid_block_additional_residual": residuals[1]}
            return self.denoiser(sample, timesteps, **inputs, return_dict=False)[0]

    def packs(self, sizes: Sequence[tuple[int, ...]]) -> bool:
        """Their latents tile into square patches the UNet downsamples whole (`engine.patched`)."""
        if ModeName.PACKED not in self.forward_modes:
            return False
        try:
            patch_side([size[-2:] for size in sizes], patch_multiple(self.denoiser))
        except ValueError:
            return False
        return True

    @torch.inference_mode()
    def denoise_mixed(
        self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor, RowConditioning]]
    ) -> list[torch.Tensor]:
        """`denoise` of each (sample, timesteps, cond) of `inputs`, samples of any sizes `packs`
        accepts, as one UNet forward over their patches with exact stitching and per-image
        GroupNorm statistics (`engine.patched.unet`): no add-ons (the step runner packs plain
        groups only)."""
        conds = [self.denoiser_inputs(cond) for _, _, cond in inputs]
        added = [c["added_cond_kwargs"] for c in conds if "added_cond_kwargs" in c]
        return patched_unet_forward(
            self.denoiser, [sample for sample, _, _ in inputs], torch.cat([t for _, t, _ in inputs]),
            torch.cat([c["encoder_hidden_states"] for c in conds]),
            {name: torch.cat([a[name] for a in added]) for name in added[0]} if added else None,
        )

    @torch.inference_mode()
    def denoise_first_block_cached(self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning,
                                   caches: Sequence[FirstBlockCache]) -> torch.Tensor:
        """`denoise` where each request's rows run the later blocks or reuse its cached step, as
        its First-Block Cache decides (`engine.step_cache`); `caches`: the requests', rows in order."""
        return first_block_cached(split_unet(self.denoiser, sample, timesteps, **self.denoiser_inputs(cond)), caches)

    def _service_residuals(self, sample: torch.Tensor, timesteps: torch.Tensor, inputs: dict[str, Any],
                           addons: StepAddons) -> Callable[[], Residuals]:
        """Send the ControlNet forwards this step needs to the service now (each ControlNet's
        uses in one call, unscaled); returns what waits for them and sums each request's
        residuals, scaled, in its order. A use that may be one step stale and has its previous
        step's residuals takes those, and its forward now is for its next step."""
        active = active_uses(addons.controls)
        for use in active:
            if use.stale is not None and use.stale.coming is not None:  # last step's, done by now
                use.stale.ready, use.stale.coming = use.stale.coming(), None
        now = [use.stale is None or use.stale.ready is None for use in active]  # waited for this step
        sends = [not (use.stale is not None and use.stale.ready is not None and use.last) for use in active]
        calls: list[tuple[list[int], Callable[[], list[Residuals]]]] = []
        for name, positions in by_controlnet(active).items():
            positions = [p for p in positions if sends[p]]
            if positions:
                unscaled = [replace(active[p], scale=1.0) for p in positions]
                calls.append((positions, self.controlnet_service.start(self.source.name, name, sample, timesteps,
                                                                       inputs, unscaled)))
        for positions, residuals in calls:  # the stale uses' next step comes from their call
            for i, p in enumerate(positions):
                if not now[p]:
                    active[p].stale.coming = functools.partial(_nth, residuals, i)

        def wait() -> Residuals:
            fresh: dict[int, Residuals] = {}
            for positions, residuals in calls:
                if any(now[p] for p in positions):
                    fresh.update((p, r) for p, r in zip(positions, residuals()) if now[p])
            per_use = []
            for p, use in enumerate(active):
                down, mid = fresh[p] if now[p] else use.stale.ready
                if use.stale is not None and now[p]:
                    use.stale.ready = (down, mid)  # this step's input: the next step's stale residuals
                per_use.append(([d * use.scale for d in down], mid * use.scale))
            return sum_residuals(sample.shape[0], active, per_use)
        return wait

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        return self.decoded_pixels(self.vae.decode(self.vae_input(latents), return_dict=False)[0])

    def decode_in_chunks(self, latents: torch.Tensor, chunks: int) -> ChunkedDecode:
        """`decode` as `chunks` sub-blocks run one at a time (SynerDiff's VAE chunking): once done,
        `decoded_pixels(result)` is `decode(latents)` bit for bit."""
        return ChunkedDecode(self.vae, self.vae_input(latents), chunks)

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        """What the pipeline hands `vae.decode`: the latents unscaled, in the VAE's dtype."""
        return latents.to(device=self.device, dtype=self.vae.dtype) / self.vae.config.scaling_factor

    def decoded_pixels(self, image: torch.Tensor) -> np.ndarray:
        """The VAE's output as the pipeline post-processes it: float pixels [B, H, W, 3] in [0, 1]."""
        return self.pipe.image_processor.postprocess(image, output_type="np", do_denormalize=[True] * image.shape[0])


def _has_submodule(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _nth(residuals: Callable[[], list[Residuals]], i: int) -> Residuals:
    return residuals()[i]
