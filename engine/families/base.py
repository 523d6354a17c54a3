"""The small interface every model family implements, and where its weights come from."""

from __future__ import annotations

import inspect
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Collection, Sequence

import diffusers
import numpy as np
import torch

from stepserve.engine.forward_modes.base import ModeName
from stepserve.policies.types import RequestKind, RequestSpec

# Components a process may load; each process loads only what it runs.
TEXT, DENOISER, VAE = "text", "denoiser", "vae"
ALL_PARTS = frozenset({TEXT, DENOISER, VAE})

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOCAL = dict(use_safetensors=True, local_files_only=True)  # weights from a folder: safetensors only, never the hub

# A batch of texts' embeddings by name, each with the texts along dim 0: "context" [n, seq, dim]
# (the denoiser's cross-attention input) in every family, and "pooled" [n, dim] in families whose
# denoiser also takes a pooled text embedding (SDXL, SD3, Flux).
TextEmbeddings = dict[str, torch.Tensor]
# One forward's conditioning by name, one row per sample row: the text embeddings of each row
# ([uncond, cond] under CFG) and whatever else the family's denoiser takes per row (SDXL's
# micro-conditioning `time_ids`). Requests batched together are concatenated key by key.
RowConditioning = dict[str, torch.Tensor]


def kept_in_fp32(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The floating parameters and buffers, by name, of what the model class marks
    `_keep_in_fp32_modules` (T5's feed-forward output, Wan's rope, time embedder and modulation
    tables): `from_pretrained(torch_dtype=...)` leaves them in float32."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    return {name: tensor for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if tensor.is_floating_point() and any(k in name.split(".") for k in keep)}


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to `dtype` but leave what `kept_in_fp32` names at its own precision, as
    `from_pretrained(torch_dtype=...)` does."""
    if module.dtype == dtype:  # diffusers warns on a no-op cast
        return
    kept = {}
    if dtype in (torch.float16, torch.bfloat16):
        kept = {name: tensor.data for name, tensor in kept_in_fp32(module).items()}
    module.to(dtype=dtype)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in kept:
            tensor.data = kept[name]


def folder_scheduler(path: str, pipeline_cls: Any) -> Any:
    """The scheduler a local diffusers folder's model_index names, after checking the folder is
    there (the first step of every family's folder loader)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    scheduler_cls = getattr(diffusers, pipeline_cls.load_config(path)["scheduler"][1])
    return scheduler_cls.from_pretrained(path, subfolder="scheduler")


@dataclass(frozen=True)
class ModelSource:
    """Where a served model's weights come from: a preset (random weights from configs,
    deterministic by `seed`) or a local diffusers folder (safetensors only)."""

    name: str
    family: str
    preset: str | None = None
    path: str | None = None
    seed: int = 0
    dtype: str = "float32"
    scheduler: str | None = None  # diffusers scheduler class name; None keeps the model's own

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ValueError(f"model {self.name!r}: give exactly one of preset or path")
        if self.dtype not in DTYPES:
            raise ValueError(f"model {self.name!r}: dtype must be one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class DiffusionFamily(ABC):
    """One architecture: encode text, run one batched denoiser forward, decode latents.

    Sampling state (scheduler, generator, latents) is per request and lives in
    `engine.sampler.Sampler`; a family holds only weights and stateless helpers, among them the
    few places where its diffusers pipeline samples differently from another's (the `Sampler`
    hooks below; their defaults are what `StableDiffusionPipeline` does).

    The class attributes say what the family generates and how it may be served, so code that
    has only the class (request validation, config) can read them without loading weights.
    """

    kind: ClassVar[RequestKind]  # what its requests generate
    size_multiple: ClassVar[int]  # height and width must be multiples of this (its pipeline refuses others)
    frame_step: ClassVar[int]  # valid frame counts are 1 + k * frame_step
    sequence_parallel: ClassVar[bool] = False  # `denoise` can split one forward over an SP group
    # A finished request is decoded by the worker that holds its latents (with a VAE loaded
    # there), instead of its latents going to a separate VAE deployment.
    decode_on_worker: ClassVar[bool] = False
    # Guidance by a second, unconditional row per request (`RequestSpec.cfg`); False where the
    # model is guidance-distilled and takes `guidance_scale` as an input (Flux).
    classifier_free_guidance: ClassVar[bool] = True
    # Takes ControlNets and LoRAs: `denoise` accepts `addons` (`engine.addons.StepAddons`) and the
    # family holds them by name in `controlnets` and `loras`.
    takes_addons: ClassVar[bool] = False
    # Serves masked edits (`RequestKind.EDIT`) as its diffusers inpaint pipeline does with the base
    # denoiser: it has `encode_image`, `image_latents` and `noise_image` (`engine.inpaint`), and
    # its workers load its VAE to encode the images.
    edits: ClassVar[bool] = False
    # The forward modes it has beyond the plain forward and the CFG split (`engine.forward_modes`):
    # PACKED, requests of different resolutions in one forward (PatchedServe §4: `packs` says
    # which sizes, `denoise_mixed` runs each member's (sample, timesteps, cond) as `denoise`
    # gives it alone); TEMPLATE_EDIT, edits of a template reusing its cached activations
    # (`engine.template_edits`: `patch_size`, `cache_slots`, `denoise_recording`,
    # `denoise_masked`, `dit_dims`); PATCH_CACHE, a request reusing its patches across steps
    # (PatchedServe §5, `engine.patch_cache`: `denoise_patch_cached`); STEP_CACHE, a request
    # reusing its last step's later blocks (`engine.step_cache`: `denoise_first_block_cached`).
    forward_modes: ClassVar[frozenset[ModeName]] = frozenset()

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    vae_scale_factor: int
    latent_channels: int

    @classmethod
    @abstractmethod
    def load(cls, source: ModelSource, parts: Collection[str], device: str | torch.device) -> "DiffusionFamily":
        """Build or load only `parts` (subset of ALL_PARTS) on `device`."""

    @classmethod
    def max_side(cls, source: ModelSource) -> int | None:
        """The largest height or width, in pixels, that the model's weights can denoise (a DiT's
        learned positional table), read from the preset's or the folder's configs without loading
        weights; None where nothing bounds it or the folder cannot be read here."""
        return None

    @abstractmethod
    def encode_text(self, texts: Sequence[str]) -> TextEmbeddings:
        """Every text's embeddings, in order along dim 0. Prompts and negative prompts alike."""

    def zero_negative(self, text: str) -> bool:
        """Whether the negative prompt `text` conditions as all-zero embeddings instead of being
        encoded (SDXL's `force_zeros_for_empty_prompt`: its pipeline does so for no negative
        prompt, which a request says with an empty one)."""
        return False

    @abstractmethod
    def make_scheduler(self) -> Any:
        """A fresh scheduler instance: diffusers schedulers count steps, so each request owns one."""

    @abstractmethod
    def denoise(
        self, sample: torch.Tensor, timesteps: torch.Tensor, cond: RowConditioning, sp_group: Any = None
    ) -> torch.Tensor:
        """One forward over a batch with a per-sample timestep vector; with `sp_group` (a
        torch.distributed group; only where `sequence_parallel`) split over that group's ranks."""

    def packs(self, sizes: Sequence[tuple[int, ...]]) -> bool:
        """Whether latents of these sizes ([C, h, w] of each member) can share one `denoise_mixed`
        forward: never, unless the family has the packed forward mode."""
        return ModeName.PACKED in self.forward_modes

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, ...] → float pixels in [0, 1]: images [B, H, W, 3], videos [B, F, H, W, 3]."""

    def decode_in_chunks(self, latents: torch.Tensor, chunks: int) -> Any:
        """`decode` as an `engine.vae_chunking.ChunkedDecode` of `chunks` sub-blocks, whose result
        `decoded_pixels` turns into what `decode` returns: the image families' (their VAE is an
        `AutoencoderKL`); the others raise."""
        raise ValueError(f"model {self.source.name!r} ({type(self).__name__}) cannot decode in chunks")

    # ---- how its pipeline samples (the `Sampler` hooks) ---------------------------------

    @abstractmethod
    def initial_latents(self, spec: RequestSpec, scheduler: Any, generator: torch.Generator) -> torch.Tensor:
        """The starting noise for one request, drawn from `generator` exactly as the pipeline does."""

    def row_conditioning(self, spec: RequestSpec, text: TextEmbeddings) -> RowConditioning:
        """The request's per-row conditioning from its rows' text embeddings (one row, or
        [uncond, cond] under CFG): by default the text alone."""
        return dict(text)

    def prepare_scheduler(self, scheduler: Any, spec: RequestSpec) -> None:
        """Set a fresh scheduler's timesteps for `spec` as the pipeline does before its loop
        (flow-matching pipelines shift them by the image's size)."""
        scheduler.set_timesteps(spec.num_inference_steps, device=self.device)

    def scale_model_input(self, scheduler: Any, sample: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return scheduler.scale_model_input(sample, t)

    # ---- how its inpaint pipeline edits (where `edits`) -----------------------------------

    @classmethod
    def skipped_steps(cls, num_inference_steps: int, strength: float) -> int:
        """The first timesteps an edit at `strength` skips, as `StableDiffusionInpaintPipeline.
        get_timesteps` rounds them (`RequestSpec.skip_steps`; 0 or more, may leave none to run)."""
        return num_inference_steps - min(int(num_inference_steps * strength), num_inference_steps)

    def encode_image(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent distribution (mean, std) of pixels [1, 3, H, W] in [-1, 1]."""
        raise NotImplementedError(f"model {self.source.name!r} ({self.source.family}) does not edit images")

    def image_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """A sample of `encode_image`'s distribution as the pipeline's `_encode_vae_image` scales it."""
        raise NotImplementedError(f"model {self.source.name!r} ({self.source.family}) does not edit images")

    def noise_image(self, scheduler: Any, image_latents: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor) -> torch.Tensor:
        """The image's latents noised to timestep `t` ([1]) with `noise`, as the pipeline's scheduler does."""
        raise NotImplementedError(f"model {self.source.name!r} ({self.source.family}) does not edit images")

    def step_kwargs(self, scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
        """Extra `scheduler.step` arguments. As `StableDiffusionPipeline.prepare_extra_step_kwargs`:
        only schedulers that take them get them."""
        params = inspect.signature(scheduler.step).parameters
        kwargs: dict[str, Any] = {}
        if "eta" in params:
            kwargs["eta"] = 0.0
        if "generator" in params:
            kwargs["generator"] = generator
        return kwargs
