"""The application config: what `build_app(args)` accepts, from Python or a Serve YAML.

Pydantic lives here, at the edge; everything below receives plain frozen dataclasses.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..actors.pool import WorkerPoolSpec
from ..engine.families import FAMILIES, ModelSource
from ..policies.genserve import GenServeConfig

# The router.policy that deploys the image + video co-serving router instead of `Router`.
COSERVE_POLICY = "genserve"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    name: str = Field(description="Model id clients send in `model` and see in GET /v1/models.")
    family: str = Field(default="sd15", description=f"Architecture family; one of {sorted(FAMILIES)}.")
    preset: str | None = Field(
        default=None, description="Random-weight preset built from configs ('tiny', 'full'); excludes `path`."
    )
    path: str | None = Field(
        default=None, description="Local diffusers-format folder with safetensors weights; excludes `preset`."
    )
    seed: int = Field(default=0, description="Weight seed for presets; presets are deterministic by seed.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(default="float32", description="Weight dtype.")
    scheduler: str | None = Field(
        default=None, description="diffusers scheduler class name to use instead of the model's own."
    )
    min_size: int = Field(default=64, ge=8, description="Smallest width/height in pixels accepted.")
    max_size: int = Field(default=1024, ge=8, description="Largest width/height in pixels accepted.")
    max_pixels: int = Field(default=1024 * 1024, ge=64, description="Largest width*height accepted.")
    default_size: str = Field(default="512x512", description="Size used when a request omits it or says 'auto'.")
    default_steps: int = Field(default=30, ge=1, description="num_inference_steps when a request omits it.")
    max_steps: int = Field(default=150, ge=1, description="Largest num_inference_steps accepted.")
    default_guidance_scale: float = Field(default=7.5, ge=0, description="guidance_scale when omitted.")
    slo_s: float | None = Field(
        default=None, gt=0,
        description="Latency objective of this model's requests in seconds from arrival; the 'genserve' "
                    "policy schedules against it (None: best effort, after everything with an SLO).",
    )
    # Video models only (see `is_video`); image models ignore these four.
    default_num_frames: int = Field(
        default=81, ge=1, description="Frames when a video request gives neither seconds nor num_frames."
    )
    max_num_frames: int = Field(default=81, ge=1, description="Most frames a video request may ask for.")
    default_fps: int = Field(default=16, ge=1, description="Frame rate of the video file when a request omits fps.")
    max_fps: int = Field(default=60, ge=1, description="Largest fps a video request may ask for.")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        self.to_source()  # preset xor path, family known
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {sorted(FAMILIES)}")
        if self.min_size > self.max_size:
            raise ValueError("min_size must be <= max_size")
        if self.default_num_frames > self.max_num_frames or self.default_fps > self.max_fps:
            raise ValueError("default_num_frames/default_fps must not exceed max_num_frames/max_fps")
        return self

    @property
    def is_video(self) -> bool:
        """Whether this model makes videos: its family can shape one (Wan); the others make images."""
        return hasattr(FAMILIES[self.family], "video_shape")

    def to_source(self) -> ModelSource:
        return ModelSource(
            name=self.name, family=self.family, preset=self.preset, path=self.path, seed=self.seed,
            dtype=self.dtype, scheduler=self.scheduler,
        )


class WorkersConfig(_Strict):
    num_workers: int = Field(default=2, ge=1, description="Denoiser workers (one per GPU on a GPU cluster).")
    max_batch_size: int = Field(default=8, ge=1, description="Requests resident and stepping together per worker.")
    num_cpus: float = Field(default=0.5, ge=0, description="Ray CPUs reserved per worker.")
    num_gpus: float = Field(default=0, ge=0, description="Ray GPUs per worker (1 on a GPU cluster).")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="'auto' uses CUDA when present.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads per worker.")

    def to_spec(self) -> WorkerPoolSpec:
        return WorkerPoolSpec(**self.model_dump())


class RouterConfig(_Strict):
    policy: str = Field(
        default="continuous",
        description=f"Scheduling policy name (policies registry), or {COSERVE_POLICY!r}: the image + video "
                    "co-serving router (GenServe), needed to serve video models.",
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the policy's config (for 'genserve': GenServeConfig fields, e.g. sp_degrees).",
    )
    profiles: list[str] = Field(
        default_factory=list,
        description="Latency profiles (names in configs/profiles or CSV paths) the 'genserve' policy predicts "
                    "step times from, covering every served model; required with it.",
    )
    max_queue_len: int = Field(default=256, ge=1, description="Queued requests beyond which new ones get 429.")
    pipeline_depth: int = Field(
        default=2, ge=1, le=4,
        description="Plans queued per worker: 2 hides the router round trip; 1 is strict lockstep.",
    )


class ComponentConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, description="Serve replicas of this deployment.")
    num_cpus: float = Field(default=0.1, ge=0, description="Ray CPUs per replica.")
    num_gpus: float = Field(default=0, ge=0, description="Ray GPUs per replica.")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="'auto' uses CUDA when present.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads per replica.")


class TextEncoderConfig(ComponentConfig):
    max_batch_size: int = Field(default=16, ge=1, description="Prompts encoded together (serve.batch).")
    batch_wait_timeout_s: float = Field(default=0.002, ge=0, description="Wait to fill a text batch.")
    cache_size: int = Field(default=4096, ge=0, description="Embeddings kept, LRU by (model, text).")


class LimitsConfig(_Strict):
    max_n: int = Field(default=4, ge=1, description="Largest `n` (images per request).")
    max_prompt_chars: int = Field(default=4000, ge=1, description="Longest prompt/negative_prompt in characters.")
    max_guidance_scale: float = Field(default=30.0, ge=0, description="Largest guidance_scale accepted.")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="Largest HTTP request body.")


class AppConfig(_Strict):
    models: list[ModelConfig] = Field(min_length=1, description="Served models; the first is the default.")
    workers: WorkersConfig = Field(default_factory=WorkersConfig, description="Denoiser worker pool.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Queue and scheduling policy.")
    text_encoder: TextEncoderConfig = Field(default_factory=TextEncoderConfig, description="Text encoder.")
    vae_decoder: ComponentConfig = Field(default_factory=ComponentConfig, description="VAE decode + PNG.")
    ingress: ComponentConfig = Field(default_factory=ComponentConfig, description="HTTP/handle ingress.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request validation limits.")
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted bearer tokens; empty (and no api_keys_env) means auth is off."
    )
    api_keys_env: str | None = Field(
        default=None, description="Environment variable holding comma-separated bearer tokens (read at start)."
    )

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        return models

    @model_validator(mode="after")
    def _check_router(self) -> "AppConfig":
        videos = [m.name for m in self.models if m.is_video]
        if videos and self.router.policy != COSERVE_POLICY:
            raise ValueError(f"video models {videos} need router.policy {COSERVE_POLICY!r} (the co-serving router)")
        if self.router.policy == COSERVE_POLICY:
            if not self.router.profiles:
                raise ValueError(f"router.policy {COSERVE_POLICY!r} needs router.profiles (latency profiles)")
            self.genserve_config()  # unknown or bad options fail here, at deploy time
        return self

    def genserve_config(self) -> GenServeConfig:
        options = {"image_max_batch": self.workers.max_batch_size, **self.router.policy_options}
        if "sp_degrees" in options:
            options["sp_degrees"] = tuple(options["sp_degrees"])
        try:
            return GenServeConfig(**options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"router.policy_options for {COSERVE_POLICY!r}: {exc}") from None

    def model(self, name: str | None) -> ModelConfig | None:
        if name is None:
            return self.models[0]
        return next((m for m in self.models if m.name == name), None)

    def resolved_api_keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        return tuple(keys)
