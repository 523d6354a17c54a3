"""The small interface every model family implements, and where its weights come from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import numpy as np
import torch

# Components a process may load; each process loads only what it runs.
TEXT, DENOISER, VAE = "text", "denoiser", "vae"
ALL_PARTS = frozenset({TEXT, DENOISER, VAE})

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
    `engine.sampler.RequestSampler`; a family holds only weights and stateless helpers.
    """

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    vae_scale_factor: int
    latent_channels: int

    @classmethod
    @abstractmethod
    def load(cls, source: ModelSource, parts: Collection[str], device: str | torch.device) -> "DiffusionFamily":
        """Build or load only `parts` (subset of ALL_PARTS) on `device`."""

    @abstractmethod
    def encode_text(self, texts: Sequence[str]) -> torch.Tensor:
        """One embedding per text: [len(texts), seq, dim]. Prompts and negative prompts alike."""

    @abstractmethod
    def make_scheduler(self) -> Any:
        """A fresh scheduler instance: diffusers schedulers count steps, so each request owns one."""

    @abstractmethod
    def initial_latents(self, height: int, width: int, scheduler: Any, generator: torch.Generator) -> torch.Tensor:
        """The starting noise for one image, drawn from `generator` exactly as the pipeline does."""

    @abstractmethod
    def denoise(self, sample: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """One forward over a batch with a per-sample timestep vector."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, h, w] → float images [B, H, W, 3] in [0, 1]."""
