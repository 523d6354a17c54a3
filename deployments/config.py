"""The application config: what `build_app(args)` accepts, from Python or a Serve YAML.

Pydantic lives here, at the edge; everything below receives plain frozen dataclasses.
"""

from __future__ import annotations

import csv
import os
import re
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stepserve.deployments.job_journal import JournalSpec
from stepserve.engine.addons.source import AddonKind, AddonSource
from stepserve.engine.editing.loading_plan import SERVED_LOADINGS, LoadingPlanner
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.families import FAMILIES, ModelSource, family_class
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.patch_cache.calibration import PatchCacheSpec
from stepserve.engine.round_sequencer import PROFILE_COLUMNS, SequencerSpec, TableKey, load_controller
from stepserve.policies import needs_costs, options_for_workers
from stepserve.policies.addon_costs import ControlNetPlacement
from stepserve.policies.cost_model import read_profile, resolve_profile
from stepserve.policies.instgenie.block_profile import MeasuredBlockCosts
from stepserve.policies.instgenie.pipeline_dp import Loading
from stepserve.policies.registry import validate_policy
from stepserve.policies.synerdiff.skip_cfg import SkipCfgCurve
from stepserve.policies.synerdiff.types import ConcurrencyTable
from stepserve.policies.types import LoraBatching, RequestKind, StepCacheMethod
from stepserve.routing.pool_scaler import ScalingSpec


if TYPE_CHECKING:
    from stepserve.actors.activation_store import ActivationStoreSpec
    from stepserve.actors.worker_options import WorkerPoolSpec
    from stepserve.routing.core import CoreConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
# stepserve's configs folder, in a checkout or installed: the shipped weights live under it.
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def local_path(path: str | None) -> str | None:
    """A configured weights path, absolute: as given where it exists from here, else a relative
    path under stepserve's configs folder (where the shipped weights are, e.g.
    `models/shapes/sd`), so a config names them the same from any working directory."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return None if path is None else os.path.abspath(path)
    shipped = CONFIGS / path
    return str(shipped) if shipped.exists() else path


def check_size(text: str, model: "ModelConfig", multiple: int) -> tuple[int, int]:
    """(width, height) of a "WxH" size that `model` accepts, sides multiples of `multiple` (its
    family's `size_multiple`); ValueError saying what is wrong. Requests and the configured
    `default_size` are held to the same rules."""
    match = SIZE.match(text)
    if not match:
        raise ValueError(f"size must look like '512x512' or be 'auto', got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if side % multiple:
            raise ValueError(f"width and height must be multiples of {multiple}, got {text}")
        if not model.min_size <= side <= model.max_size:
            raise ValueError(f"{model.name} accepts sides from {model.min_size} to {model.max_size} px, got {text}")
    if width * height > model.max_pixels:
        raise ValueError(f"{text} exceeds {model.name}'s limit of {model.max_pixels} pixels")
    return width, height


class ModelConfig(_Strict):
    name: str = Field(description="Model id clients send in `model` and see in GET /v1/models.")
    family: str = Field(default="sd15", description=f"Architecture family; one of {sorted(FAMILIES)}.")
    preset: str | None = Field(
        default=None, description="Random-weight preset built from configs ('tiny', 'full'); excludes `path`."
    )
    path: str | None = Field(
        default=None, description="Local diffusers-format folder with safetensors weights; excludes `preset`. A "
                                  "relative path missing from the working directory is looked up under stepserve's "
                                  "configs folder (the shipped models: 'models/shapes/sd').")
    seed: int = Field(default=0, description="Weight seed for presets; presets are deterministic by seed.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(default="float32", description="Weight dtype.")
    scheduler: str | None = Field(
        default=None, description="diffusers scheduler class name to use instead of the model's own."
    )
    min_size: int = Field(default=64, ge=8, description="Smallest width/height in pixels accepted.")
    max_size: int = Field(default=1024, ge=8, description="Largest width/height in pixels accepted.")
    max_pixels: int = Field(default=1024 * 1024, ge=64, description="Largest width*height accepted.")
    default_size: str = Field(default="512x512", description="Size used when a request omits it or says 'auto'.")
    default_steps: int = Field(
        default=30, ge=1,
        description="num_inference_steps when a request omits it; also the steps of an image request's quality "
                    "'medium' (and 'auto', 'standard').")
    max_steps: int = Field(default=150, ge=1, description="Largest num_inference_steps accepted.")
    low_quality_steps: int | None = Field(
        default=None, ge=1,
        description="Steps of an image request with quality 'low' and no num_inference_steps; None: half of "
                    "default_steps, rounded up. At most default_steps.")
    high_quality_steps: int | None = Field(
        default=None, ge=1,
        description="Steps of an image request with quality 'high' (or 'hd') and no num_inference_steps; None: twice "
                    "default_steps, at most max_steps. At least default_steps.")
    default_guidance_scale: float = Field(default=7.5, ge=0, description="guidance_scale when omitted.")
    slo_s: float | None = Field(
        default=None, gt=0,
        description="Latency objective of this model's requests in seconds from arrival; SLO-aware policies "
                    "('genserve') schedule against it (None: best effort, after everything with an SLO).",
    )
    step_cache: float = Field(
        default=0.0, ge=0, description="First-Block Cache threshold of this model's requests that give none "
        "(`step_cache` in the body): a step whose first-block output moved less than this since the request's last "
        "computed step reuses that step's later blocks. 0: off, every step exact. Families with the step-cache "
        "forward mode only (SD1.5, SDXL, SD3); README 'Step caching' has the measured speed and fidelity.")
    step_cache_method: StepCacheMethod = Field(
        default=StepCacheMethod.FIRST_BLOCK, description="What a step the cache skips takes when the request does "
        "not say: 'first_block' (the later blocks' last result as it was) or 'taylorseer' (extrapolated to first "
        "order from the last two computed steps).")
    max_step_cache: float = Field(
        default=0.2, ge=0, description="The fidelity floor: the largest threshold a request may ask for (400 above "
        "it). 0.2 keeps SSIM >= 0.95 against the exact image on the shapes model (docs/results/step-cache).")
    skip_cfg_quality: float = Field(
        default=1.0, gt=0, le=1, description="SynerDiff's adaptive skip-CFG: the quality threshold S. A request "
        "runs without its unconditional row from the first step from which, by `skip_cfg_curve`, skipping to the end "
        "keeps its picture at least this similar (SSIM) to the exact one. 1: off, every step guided (exact). Models "
        "that guide by CFG only; README 'Skip-CFG' has the measured speed and fidelity.")
    min_skip_cfg_quality: float = Field(
        default=0.95, gt=0, le=1, description="The fidelity floor of skip-CFG: the lowest quality S a request may ask "
        "for (`skip_cfg_quality` in the body; 400 below it).")
    skip_cfg_curve: list[tuple[float, float]] = Field(
        default_factory=list, description="The model's measured skip-CFG curve (needed when skip_cfg_quality < 1): "
        "points (fraction of the steps from which requests skip CFG, their pictures' mean SSIM against exact), as "
        "`python -m stepserve.load_tests.bench_skip_cfg` prints them.")
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
        try:  # else every request without a size would be refused
            check_size(self.default_size, self, family_class(self.family).size_multiple)
        except ValueError as exc:
            raise ValueError(f"default_size: {exc}") from None
        limit = family_class(self.family).max_side(self.to_source())
        if limit is not None and self.max_size > limit:
            raise ValueError(f"max_size {self.max_size} exceeds the {limit} px sides model {self.name!r} can denoise "
                             "(its transformer's positional table)")
        if self.step_cache > self.max_step_cache:
            raise ValueError(f"step_cache {self.step_cache} exceeds max_step_cache {self.max_step_cache}")
        if self.step_cache and ModeName.STEP_CACHE not in family_class(self.family).forward_modes:
            raise ValueError(f"family {self.family!r} has no step cache; step_cache must be 0")
        if self.skip_cfg_quality < self.min_skip_cfg_quality:
            raise ValueError(f"skip_cfg_quality {self.skip_cfg_quality} is below min_skip_cfg_quality "
                             f"{self.min_skip_cfg_quality}")
        if self.skip_cfg_quality < 1 and not self.skip_cfg_curve:
            raise ValueError("skip_cfg_quality < 1 needs the model's measured skip_cfg_curve")
        if self.skip_cfg_quality < 1 and not family_class(self.family).classifier_free_guidance:
            raise ValueError(f"family {self.family!r} does not guide by CFG; skip_cfg_quality must be 1")
        if self.skip_cfg_curve:
            SkipCfgCurve(tuple(tuple(point) for point in self.skip_cfg_curve))  # points in [0, 1], f increasing
        if self.default_num_frames > self.max_num_frames or self.default_fps > self.max_fps:
            raise ValueError("default_num_frames/default_fps must not exceed max_num_frames/max_fps")
        low, medium, high = (self.quality_steps(preset) for preset in ("low", "medium", "high"))
        if not 1 <= low <= medium <= high <= self.max_steps:  # else a request naming a quality would be refused
            raise ValueError(f"need 1 <= low_quality_steps ({low}) <= default_steps ({medium}) <= high_quality_steps "
                             f"({high}) <= max_steps ({self.max_steps})")
        return self

    def skip_cfg_from(self, quality: float | None = None) -> float:
        """The fraction of a request's steps from which it skips CFG (`RequestSpec.skip_cfg_from`):
        where its curve keeps SSIM >= `quality` (default: `skip_cfg_quality`) from there to the end;
        1: never."""
        quality = self.skip_cfg_quality if quality is None else quality
        if quality == 1:
            return 1.0
        curve = SkipCfgCurve(tuple(tuple(point) for point in self.skip_cfg_curve))
        fraction = curve.first_fraction(quality)
        return 1.0 if fraction is None else fraction

    def quality_steps(self, preset: str) -> int:
        """The denoising steps of an image request's quality preset ('low', 'medium' or 'high')."""
        if preset == "low":
            return self.low_quality_steps or (self.default_steps + 1) // 2
        if preset == "medium":
            return self.default_steps
        if preset == "high":
            return self.high_quality_steps or min(2 * self.default_steps, self.max_steps)
        raise ValueError(f"unknown quality preset {preset!r}")

    @property
    def kind(self) -> RequestKind:
        """What this model makes, as its family declares it."""
        return family_class(self.family).kind

    @property
    def is_video(self) -> bool:
        return self.kind is RequestKind.T2V

    def to_source(self) -> ModelSource:
        return ModelSource(
            name=self.name, family=self.family, preset=self.preset, path=local_path(self.path), seed=self.seed,
            dtype=self.dtype, scheduler=self.scheduler,
        )


class AddonConfig(_Strict):
    name: str = Field(description="Id clients send in a request's `controlnets[].name` / `loras[].name`.")
    model: str = Field(description="The served model (a `models[].name`, of a family that takes add-ons: sd15, "
                                   "sdxl) it applies to.")
    preset: str | None = Field(
        default=None, description="Random weights sized for the model's preset (must equal the model's `preset`); "
                                  "excludes `path`.")
    path: str | None = Field(
        default=None, description="Local weights, safetensors only: a diffusers ControlNet folder; a LoRA "
                                  ".safetensors file or a folder holding pytorch_lora_weights.safetensors. Excludes "
                                  "`preset`. Relative paths resolve as a model's `path` does.")
    seed: int = Field(default=0, description="Weight seed for presets.")

    def to_source(self, kind: AddonKind) -> AddonSource:
        return AddonSource(kind, self.name, self.model, self.preset, local_path(self.path), self.seed)


class LoraConfig(AddonConfig):
    join_by: float | None = Field(
        default=None, ge=0, lt=1,
        description="How late this LoRA may join a request, as a fraction of its steps: its profiled bound k / steps "
                    "(SwiftDiffusion §4.2; `stepserve lora-bound --lora-path <its file>` prints it as `join_by`). The "
                    "LoRA applies from the first step after it arrives, at this fraction at the latest. Unset: "
                    "`lora_loading.join_by`. 0: exact (the request waits until the store holds it).")

    def to_source(self, kind: AddonKind = AddonKind.LORA) -> AddonSource:
        return replace(super().to_source(kind), join_by=self.join_by)


class LoraLoadingConfig(_Strict):
    join_by: float = Field(
        default=0.0, ge=0, lt=1,
        description="Bounded asynchronous LoRA loading (SwiftDiffusion §4.2): the fraction of a request's steps that "
                    "may run before its LoRAs have arrived (they join at the first step after they do, at this "
                    "fraction at the latest). 0 (exact): a request waits in the queue until the LoRA store holds its "
                    "LoRAs, and applies them from its first step. The bound of every LoRA without its own "
                    "`loras[].join_by` (`stepserve lora-bound` measures one LoRA's). Unused with `preload`.")
    preload: bool = Field(
        default=False,
        description="Load every configured LoRA on every worker at start and keep it there (no LoRA store): for a "
                    "catalog small enough to fit each worker's memory. Off: LoRAs load when requests need them.")
    store_bytes: int = Field(default=8 << 30, ge=1 << 20,
                             description="Host memory per node for LoRA weights (the node's LoRA store, LRU).")
    max_resident: int = Field(default=32, ge=1, description="LoRAs each worker keeps in its device memory (LRU).")
    batches: LoraBatching = Field(
        default=LoraBatching.MIXED,
        description="'mixed': one forward batches requests with different LoRAs, each row with its own unmerged "
                    "low-rank updates. 'per_adapter': a forward takes requests of one LoRA set only, the way "
                    "vLLM-Omni and SGLang batch (smaller batches; `python -m stepserve.load_tests.bench_addons_sim` "
                    "compares the two). Exact either way.")


class EditCacheConfig(_Strict):
    enabled: bool = Field(
        default=False,
        description="Edits that name a `template_id` reuse the template's cached activations (InstGenIE §3.1): the "
                    "first edit of a template (model, size, steps, strength, CFG alike) runs exact and records every "
                    "transformer block's output at every step; later edits compute only their masked tokens and take "
                    "the rest from that record. An approximation (`python -m stepserve.load_tests.bench_edit_cache` "
                    "measures its speed and fidelity); off: every edit is exact. Models whose family has "
                    "the template-edit forward mode (SD3) only.")
    cache: CacheKind = Field(
        default=CacheKind.KEYS_VALUES,
        description="What a template's record holds: 'keys_values' (each block's image keys and values: an edit "
                    "computes nothing but its masked tokens; twice the bytes; the paper's Fig. 7) or 'outputs' (each "
                    "block's image-token outputs: keys and values are recomputed over every token; the paper's main "
                    "design).")
    memory_bytes: int = Field(default=16 << 30, ge=1 << 20,
                              description="Host memory per node for templates' activations (the node's activation "
                                          "store, LRU).")
    worker_bytes: int = Field(default=4 << 30, ge=0,
                              description="Host memory each worker keeps the records it used last in (LRU): a hot "
                                          "template's edits on one worker skip the copy from the node's store. 0: "
                                          "every edit asks the store.")
    disk_dir: str | None = Field(default=None, description="A local folder each node's store spills least recently "
                                                           "used templates to (safetensors); None: they are dropped.")
    disk_bytes: int | None = Field(default=None, ge=1 << 20, description="Disk per node for spilled templates (LRU); "
                                                                         "None: unbounded.")
    loading: Loading = Field(
        default=Loading.ALGORITHM1,
        description="Which cache slots a masked forward with cached block outputs ('outputs') loads, decided by "
                    "the worker per forward from the block costs in `router.profiles` (`stepserve profile` measures "
                    "them) at the forward's size, rows and mask ratio (InstGenIE §4.2): 'algorithm1' (the paper's "
                    "Algorithm 1), 'optimal' (the exact optimum of the same pipeline) or 'always_load' (every slot). "
                    "A block that does not load computes every token, which is at least as exact. Without costs for "
                    "a shape every slot loads (counted in stepserve_edit_unplanned_forwards); a 'keys_values' "
                    "record always loads every slot.")

    @field_validator("loading", mode="before")
    @classmethod
    def _served_loading(cls, value: Any) -> Any:
        if str(getattr(value, "value", value)) not in [m.value for m in SERVED_LOADINGS]:
            raise ValueError(f"edit_cache.loading {value!r} is not a way to serve; one of "
                             f"{[m.value for m in SERVED_LOADINGS]}")
        return value

    def planner(self, profiles: list[str]) -> LoadingPlanner:
        """How workers choose the slots a masked forward loads: `loading` over the block costs of
        `profiles` (read once here; none needed for 'always_load' or a 'keys_values' record)."""
        if not self.enabled or self.loading is Loading.ALWAYS_LOAD or self.cache is CacheKind.KEYS_VALUES:
            return LoadingPlanner(self.loading)
        rows = [row for name in profiles for row in read_profile(resolve_profile(name))]
        return LoadingPlanner(self.loading, MeasuredBlockCosts.from_rows(rows))

    def store_spec(self) -> "ActivationStoreSpec | None":
        from stepserve.actors.activation_store import ActivationStoreSpec  # imports Ray: not for the one-shot CLI

        return ActivationStoreSpec(self.memory_bytes, self.disk_dir, self.disk_bytes) if self.enabled else None


class PatchCacheConfig(_Strict):
    enabled: bool = Field(
        default=False,
        description="SD3 requests reuse, per block and patch, their previous step's output where a learned predictor "
                    "says the patch barely changed (PatchedServe §5, §7), computing only the other patches. An "
                    "approximation (`python -m stepserve.load_tests.bench_patch_cache` measures its fidelity and "
                    "speed); each worker calibrates the predictor at startup from fixed generations and loads the "
                    "model's text encoders to do so. Off: every step is exact.",
    )
    tolerance: float = Field(default=1e-2, gt=0, le=1,
                             description="A reuse is right where the output it reuses is within this relative MSE "
                                         "of the exact one: larger reuses more and strays further.")
    side: int = Field(default=4, ge=1, le=64, description="Patch side in image tokens (SD3: 4 tokens = 64 px).")
    full_steps: int = Field(default=1, ge=1, description="Each request's first steps computed in full.")
    calibration_size: int = Field(default=256, ge=64, le=1024,
                                  description="Image side (px) of the calibration generations.")
    calibration_steps: int = Field(default=8, ge=2, le=50, description="Steps of the calibration generations.")

    def spec(self) -> PatchCacheSpec | None:
        if not self.enabled:
            return None
        return PatchCacheSpec(self.tolerance, self.side, self.full_steps, self.calibration_size,
                              self.calibration_steps)


class WorkerAutoscalingConfig(_Strict):
    min_workers: int = Field(ge=1, description="The pool never drains below this many workers.")
    max_workers: int = Field(ge=1, description="The pool never grows past this many workers (nor past what Ray's "
                                                "autoscaler can place: a worker it cannot place waits, counted).")
    target_requests: float = Field(
        default=4.0, gt=0,
        description="Requests running or waiting per worker the pool sizes itself for (as Ray Serve's "
                    "`target_ongoing_requests`): the pool grows at once to one worker per this much demand, and by "
                    "one more while waiting requests are predicted to miss their deadlines. Set it to the batch a "
                    "worker should run: for a large model at a tight SLO, well below `max_batch_size`.")
    scale_down_delay_s: float = Field(
        default=30.0, ge=0,
        description="How long the demand must want fewer workers, with nothing waiting and nothing late, before "
                    "one worker drains (one at a time): its requests move to the others at a step boundary, and its "
                    "resources go back to Ray.")

    def spec(self) -> ScalingSpec:
        return ScalingSpec(self.min_workers, self.max_workers, self.target_requests, self.scale_down_delay_s)


class WorkersConfig(_Strict):
    num_workers: int = Field(default=2, ge=1, description="Denoiser workers (one per GPU on a GPU cluster); with "
                                                          "`autoscaling`, the pool's size at start.")
    autoscaling: WorkerAutoscalingConfig | None = Field(
        default=None,
        description="Grow and shrink the pool between `min_workers` and `max_workers` from the router's load "
                    "(None: a fixed pool of `num_workers`). The router asks Ray's autoscaler for the nodes "
                    "(`ray.autoscaler.sdk.request_resources`). Where forwards may span workers (sequence-parallel "
                    "video models, a policy that splits CFG rows), each change rebuilds the workers' process-group "
                    "world once no such forward runs; none starts meanwhile.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each worker reserves besides CPUs and GPUs (e.g. a node label such as "
                    "{'gpu_node': 1}): what the autoscaler provisions a node type for.")
    max_batch_size: int = Field(default=8, ge=1, description="Requests resident and stepping together per worker.")
    num_cpus: float = Field(default=0.5, ge=0, description="Ray CPUs reserved per worker.")
    num_gpus: float = Field(default=0, ge=0, description="Ray GPUs per worker (1 on a GPU cluster).")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="'auto' uses CUDA when present.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads per worker.")
    pack_resolutions: bool = Field(
        default=False,
        description="Each step a worker runs its plan's plain image groups of one model as one forward, whatever "
                    "their resolutions (PatchedServe): SD3 and Flux pack the images' tokens, SD1.5/SDXL run a "
                    "patched UNet with per-image GroupNorm statistics. Exact (each image equals its forward alone to "
                    "float rounding). The router prices such rounds as the profile's packed rows measured them "
                    "(`stepserve profile` times every mix of its sizes), else by a roofline estimate from its "
                    "one-resolution rows. Groups with LoRAs, ControlNets, cached-activation edits or patch caches, "
                    "split over workers, and video families run one forward per group. Off by default: on this "
                    "CPU the tiny DiTs pack faster but the patched tiny UNet is slower than its groups in turn "
                    "(its profile says by how much); on a GPU the gain (fewer, larger kernels) is not measured yet.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> "WorkersConfig":
        scaling = self.autoscaling
        if scaling is not None and not scaling.min_workers <= self.num_workers <= scaling.max_workers:
            raise ValueError(f"autoscaling: need min_workers <= num_workers <= max_workers, got {scaling.min_workers}, "
                             f"{self.num_workers}, {scaling.max_workers}")
        return self

    def to_spec(self) -> "WorkerPoolSpec":
        from stepserve.actors.worker_options import WorkerPoolSpec  # imports Ray: not for the one-shot CLI

        return WorkerPoolSpec(**self.model_dump(exclude={"autoscaling", "resources"}),
                              scaling=None if self.autoscaling is None else self.autoscaling.spec(),
                              resources=tuple(sorted(self.resources.items())))


class RouterConfig(_Strict):
    policy: str = Field(
        default="continuous",
        description="Scheduling policy (a name from the policies registry): 'continuous' (step-level continuous "
                    "batching), 'static_fcfs', 'dynamic_batching' (request-level baselines), 'genserve' (SLO-aware "
                    "image + video co-serving: preemption, knapsack DP, elastic sequence parallelism) or "
                    "'latent_parallel' (a lone CFG image's two rows on two idle workers when the profile says it "
                    "pays; continuous batching otherwise).",
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the policy's config dataclass (for 'genserve': GenServeConfig fields, e.g. "
                    "sp_degrees, preemption, dp, elastic_sp, round_s).",
    )
    profiles: list[str] = Field(
        default_factory=list,
        description="Latency profiles (names in configs/profiles or CSV paths) covering every served model. "
                    "Required by policies that predict step times ('genserve'); with any policy they also time "
                    "the pipeline and the decode tail more precisely.",
    )
    max_queued_images: int = Field(
        default=256, ge=1,
        description="Image requests waiting or being decoded beyond which new ones get 429 (videos have their own "
                    "bound, so a video backlog cannot turn images away).",
    )
    max_queued_videos: int = Field(default=64, ge=1, description="The same bound for video jobs.")
    max_image_queue_wait_s: float | None = Field(
        default=None, gt=0,
        description="Reject an image (429) when its predicted queue wait, from the measured completion rate, "
                    "exceeds this; None: only the count bound applies.",
    )
    max_video_queue_wait_s: float | None = Field(default=None, gt=0, description="The same for video jobs.")
    pipeline_depth: int = Field(
        default=2, ge=1, le=4,
        description="Plans queued per worker: 2 hides the router round trip; 1 is strict lockstep.",
    )
    pipeline_lead_s: float = Field(
        default=0.05, ge=0,
        description="How long before a worker's current plan is predicted to end its next one is decided: long "
                    "enough to hide the round trip, short enough that the decision sees fresh state.",
    )
    max_plan_s: float = Field(
        default=0.3, ge=0, le=10,
        description="With a steady policy (continuous, static_fcfs, dynamic_batching), a batch nothing would change "
                    "runs several steps in one plan, up to this long: the router and the hop to the worker are "
                    "paid once per plan instead of once per step. A cancel, or a request that could join the batch "
                    "(continuous), cuts the plan short at the worker's next step. 0: one step per plan.",
    )
    checkpoint_interval_s: float | None = Field(
        default=10.0, ge=0,
        description="A running request's state is copied to host memory at most this often, so a worker fault "
                    "costs at most this much of its work; None: never (it restarts from step 0).",
    )
    max_recoveries: int = Field(default=3, ge=0, description="Worker faults one request survives before it fails.")

    @model_validator(mode="after")
    def _check_policy(self) -> "RouterConfig":
        try:
            validate_policy(self.policy, self.policy_options)
        except ValueError as exc:
            raise ValueError(f"router: {exc}") from None
        if needs_costs(self.policy) and not self.profiles:
            raise ValueError(f"router.policy {self.policy!r} predicts step times: it needs router.profiles")
        return self

    def core_config(self) -> CoreConfig:
        from stepserve.routing.core import CoreConfig  # the router's state machine: not for the one-shot CLI

        return CoreConfig(
            pipeline_depth=self.pipeline_depth, pipeline_lead_s=self.pipeline_lead_s, max_plan_s=self.max_plan_s,
            max_queued={RequestKind.T2I: self.max_queued_images, RequestKind.T2V: self.max_queued_videos},
            max_wait_s={RequestKind.T2I: self.max_image_queue_wait_s, RequestKind.T2V: self.max_video_queue_wait_s},
            checkpoint_interval_s=self.checkpoint_interval_s, max_recoveries=self.max_recoveries)


class JobsConfig(_Strict):
    ttl_s: float = Field(
        default=3600.0, gt=0,
        description="Seconds a finished video job (completed, failed or cancelled) and an idempotent image result "
                    "are kept after they end; afterwards they read as not found (404).")
    max_bytes: int = Field(
        default=2 << 30, ge=1,
        description="Bytes of finished videos' frames and remembered image responses held by the job store; the "
                    "oldest finished go first. A single video larger than this fails with 'result_too_large'.")
    max_jobs: int = Field(
        default=10_000, ge=1,
        description="Video job records kept; the oldest finished are dropped for new ones, and a create when every "
                    "record is still live gets 429.")
    storage: Literal["memory", "disk", "redis"] = Field(
        default="disk",
        description="Where the job store writes what each call changed, before the call returns, so a restarted "
                    "store loses no job, finished video, running video's checkpoint or remembered image response: "
                    "'disk' (a folder on the store's node: `disk_dir`), 'redis' (`redis_url`: survives the node; a "
                    "cluster whose store may restart elsewhere) or 'memory' (nothing survives the store).")
    disk_dir: str | None = Field(
        default=None,
        description="The folder of 'disk' storage; None: a new folder under the temp dir each time the app is "
                    "built (it survives the store's restarts, not a redeploy: name one to keep jobs across them).")
    redis_url: str | None = Field(default=None, description="'redis' storage: e.g. redis://stepserve-redis:6379/1.")
    redis_password_env: str | None = Field(
        default=None, description="'redis' storage: the environment variable, where the store runs, holding the "
                                  "password (never in the config).")
    redis_prefix: str = Field(default="stepserve", min_length=1,
                              description="'redis' storage: the prefix of the store's keys (one app a prefix).")

    @model_validator(mode="after")
    def _check_storage(self) -> "JobsConfig":
        if self.storage == "redis" and not self.redis_url:
            raise ValueError("jobs.storage 'redis' needs jobs.redis_url")
        return self

    def journal_spec(self) -> "JournalSpec | None":
        """Where the store writes through (None: memory only); a default folder is named here, once."""
        if self.storage == "memory":
            return None
        if self.storage == "redis":
            return JournalSpec("redis", redis_url=self.redis_url, redis_password_env=self.redis_password_env,
                               redis_prefix=self.redis_prefix)
        folder = self.disk_dir or os.path.join(tempfile.gettempdir(), f"stepserve-jobs-{uuid.uuid4().hex[:12]}")
        return JournalSpec("disk", disk_dir=folder)


class ComponentConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, description="Serve replicas of this deployment.")
    num_cpus: float = Field(default=0.1, ge=0, description="Ray CPUs per replica.")
    num_gpus: float = Field(default=0, ge=0, description="Ray GPUs per replica.")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="'auto' uses CUDA when present.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads per replica.")


class IngressConfig(ComponentConfig):
    open_docs: bool = Field(
        default=False,
        description="Serve GET /docs and GET /openapi.json without an API key (for development: a browser cannot "
                    "send one). Off, they need a key like every route but /health. No effect when auth is off.")


class TextEncoderConfig(ComponentConfig):
    max_batch_size: int = Field(default=16, ge=1, description="Prompts encoded together (serve.batch).")
    batch_wait_timeout_s: float = Field(default=0.002, ge=0, description="Wait to fill a text batch.")
    cache_size: int = Field(default=4096, ge=0,
                            description="Embeddings kept, LRU by (model, text); per worker when `on_workers`.")
    on_workers: bool = Field(
        default=False,
        description="Encode each request's prompts on the denoiser worker that admits it, inside the plan that "
                    "admits it (the texts of one plan's admissions in one batch), and build no text encoder "
                    "deployment (then only `cache_size` is used, each worker keeping its own cache). One process and "
                    "one hop fewer per request: the right trade on a small CPU box. Off (a text encoder "
                    "deployment), prompts are encoded while the request waits, batched across requests, and an "
                    "encode never holds up a batch's steps: the right trade on GPUs with large text encoders (T5).")


class VAEDecoderConfig(ComponentConfig):
    on_workers: bool = Field(
        default=False,
        description="Decode each image (VAE decode + PNG) on the denoiser worker that denoised it, inside its last "
                    "plan, as videos always are, and build no VAE decoder deployment (its other fields are then "
                    "unused). One process and one hop fewer per image: the right trade on a small CPU box, where "
                    "every process shares the same cores. Off (a decoder deployment), a decode never holds up "
                    "the batch's steps: the right trade on GPUs, where a large image's decode and PNG take "
                    "hundreds of ms.")
    chunks: int = Field(
        default=1, ge=1, le=64,
        description="With `on_workers`: SynerDiff's VAE chunking. Above 1, a finished image's decode runs as this "
                    "many sub-blocks (cut at the decoder's ResNet blocks), one per denoising round of its worker, "
                    "beside the round's forward and never inside the step loop, instead of whole inside its last "
                    "plan; the PNG is the same bit for bit. 1: whole, as before. At most the decoder's blocks "
                    "(18 for SD's VAE).")

    sequencer_profile: str | list[str] | None = Field(
        default=None,
        description="With `on_workers`: SynerDiff's sequencer on each worker (decodes then run beside the rounds, "
                    "in `chunks` sub-blocks, 1 included). The concurrency "
                    "profiles `stepserve profile-concurrency` measured, one path or a list (each a concurrency.csv "
                    "of one model at one size; a relative path missing from the working directory is looked up "
                    "under stepserve's configs folder): each round, a group's step is split into the sub-rounds "
                    "the 3D-DP picks on the table of its model at its size, each with its share of the pending "
                    "decodes and of the requests past their skip-CFG step; a group with no table runs as one "
                    "round. Their chunking must be `chunks`. None: one round beside every pending decode.")
    sequencer_alpha: float = Field(
        default=0.1, ge=0, le=1,
        description="The sequencer's throughput slack alpha (Eq. 3f): its sub-rounds may take this much longer "
                    "than the group's step in one round beside every decode (the paper's 0.1).")

    load_controller: bool = Field(
        default=False,
        description="With a `sequencer_profile`: SynerDiff's load feedback controller on each worker (§III-D). Each "
                    "plan carries the router's queue; when it has grown over `controller_window` plans, the "
                    "controller moves the skip-CFG start of every request that skips CFG (quality S < 1) a "
                    "third of the way from its own S's toward its model's `min_skip_cfg_quality`'s, and once "
                    "there raises the chunks of each decode that starts by one, up to `max_chunks`; when it has "
                    "shrunk (or stayed empty), it undoes them in reverse. Requests with S = 1 stay exact.")
    controller_window: int = Field(
        default=4, ge=2, le=64, description="The plans over which the load controller reads a trend in the queue.")
    max_chunks: int | None = Field(
        default=None, ge=1, le=64,
        description="With `load_controller`: the most chunks it may raise a decode to. None: `chunks` (it never "
                    "raises them).")

    @model_validator(mode="after")
    def _check_chunks(self) -> "VAEDecoderConfig":
        if self.chunks > 1 and not self.on_workers:
            raise ValueError("vae_decoder.chunks > 1 decodes on the workers: it needs vae_decoder.on_workers")
        if self.sequencer_profile is not None:
            if not self.on_workers:
                raise ValueError("vae_decoder.sequencer_profile orders decodes on the workers: it needs on_workers")
            for key, table in self.sequencer_tables().items():
                if table.chunks != self.chunks:
                    raise ValueError(f"vae_decoder.sequencer_profile of {key} was measured at {table.chunks} chunks, "
                                     f"vae_decoder.chunks is {self.chunks}")
        elif self.load_controller:
            raise ValueError("vae_decoder.load_controller runs in SynerDiff's sequencer: it needs sequencer_profile")
        if self.max_chunks is not None and not self.load_controller:
            raise ValueError("vae_decoder.max_chunks bounds the load controller's chunks: it needs load_controller")
        if self.max_chunks is not None and self.max_chunks < self.chunks:
            raise ValueError(f"vae_decoder.max_chunks ({self.max_chunks}) is below chunks ({self.chunks})")
        return self

    def sequencer_spec(self) -> SequencerSpec | None:
        """Each worker's sequencer (None without a `sequencer_profile`)."""
        if self.sequencer_profile is None:
            return None
        controller = None
        if self.load_controller:
            controller = load_controller(self.chunks, self.max_chunks or self.chunks, self.controller_window)
        return SequencerSpec(self.sequencer_tables(), self.sequencer_alpha, controller)

    def sequencer_tables(self) -> dict[TableKey, ConcurrencyTable]:
        """The sequencer's concurrency tables by (model, height, width), read from
        `sequencer_profile` (none without one)."""
        paths = [self.sequencer_profile] if isinstance(self.sequencer_profile, str) else self.sequencer_profile or []
        tables: dict[TableKey, ConcurrencyTable] = {}
        for path in map(local_path, paths):
            try:
                with open(path, newline="") as f:
                    reader = csv.DictReader(f)
                    rows = list(reader)
                missing = set(PROFILE_COLUMNS) - set(reader.fieldnames or ())
                if missing:
                    raise ValueError(f"missing columns {sorted(missing)}: measure it again with "
                                     "`stepserve profile-concurrency`")
                keys = {(r["model"], int(r["height"]), int(r["width"])) for r in rows}
                chunks = {int(r["chunks"]) for r in rows}
                if len(keys) != 1 or len(chunks) != 1:
                    raise ValueError(f"one model, size and chunking per profile, found {sorted(keys)}, "
                                     f"chunks {sorted(chunks)}")
                key = keys.pop()
                if key in tables:
                    raise ValueError(f"{key} is measured by another profile too")
                table_rows = [(int(r["unet"]), int(r["vae"]), int(r["skip"]), float(r["tau_s"]), float(r["delta_s"]))
                              for r in rows]
                tables[key] = ConcurrencyTable.from_rows(table_rows, chunks.pop(), max(r[0] for r in table_rows))
            except (OSError, KeyError, ValueError) as exc:
                raise ValueError(f"vae_decoder.sequencer_profile {path!r}: {exc}") from None
        return tables


class ControlNetServiceConfig(ComponentConfig):
    enabled: bool = Field(
        default=False,
        description="Run the ControlNets in their own deployment (SwiftDiffusion's ControlNet-as-a-Service), scaled "
                    "apart from the workers: a worker sends a step's ControlNet forwards there before its UNet starts "
                    "and adds their residuals once its mid block is done, so the ControlNets run in parallel with the "
                    "UNet's encoder (exact). Off: each worker holds the ControlNets and runs them before its UNet, as "
                    "diffusers does. Pays where the service has devices of its own (GPUs); on a few shared CPU cores "
                    "the two compete for the same cores.")
    cache_size: int = Field(default=8, ge=1, description="ControlNets each replica keeps in device memory (LRU).")
    stale: bool = Field(
        default=False,
        description="One step stale (SwiftDiffusion's pipelined ControlNet, for slow links): a step adds the residuals "
                    "of its request's previous step, computed while that step ran, so neither the ControlNet nor the "
                    "transfer is waited for (the first step of a request, or of a ControlNet's start..end, waits). An "
                    "approximation: `python -m stepserve.load_tests.bench_stale_controlnet` measures its fidelity.")
    max_ongoing_requests: int = Field(default=4, ge=1, description="ControlNet forwards one replica runs at once.")

    @property
    def placement(self) -> ControlNetPlacement:
        """Where ControlNets run, as the router's cost model prices them (`policies.addon_costs`)."""
        if not self.enabled:
            return ControlNetPlacement.INLINE
        return ControlNetPlacement.STALE if self.stale else ControlNetPlacement.SERVICE


class LimitsConfig(_Strict):
    max_n: int = Field(default=4, ge=1, description="Largest `n` (images per request).")
    max_prompt_chars: int = Field(default=4000, ge=1, description="Longest prompt/negative_prompt in characters.")
    max_guidance_scale: float = Field(default=30.0, ge=0, description="Largest guidance_scale accepted.")
    max_body_bytes: int = Field(
        default=16 << 20, ge=1024,
        description="Largest HTTP request body (control images come base64-encoded in it).")
    max_controlnets: int = Field(default=3, ge=0, description="Most ControlNets one request may use.")
    max_loras: int = Field(default=4, ge=0, description="Most LoRAs one request may use.")
    max_image_bytes: int = Field(default=8 << 20, ge=1024, description="Largest input image file (decoded from base64).")
    max_image_pixels: int = Field(
        default=4096 * 4096, ge=64,
        description="Most pixels an input image may declare; larger ones (decompression bombs) are refused before "
                    "they are decoded.")
    max_addon_scale: float = Field(default=5.0, ge=0, description="Largest ControlNet conditioning_scale or LoRA "
                                                                  "scale accepted (also negated, for LoRAs).")


class AppConfig(_Strict):
    models: list[ModelConfig] = Field(min_length=1, description="Served models; the first is the default.")
    workers: WorkersConfig = Field(default_factory=WorkersConfig, description="Denoiser worker pool.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Queues and the scheduling policy.")
    text_encoder: TextEncoderConfig = Field(default_factory=TextEncoderConfig, description="Text encoder.")
    vae_decoder: VAEDecoderConfig = Field(default_factory=VAEDecoderConfig, description="VAE decode + PNG (images).")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="HTTP/handle ingress.")
    jobs: JobsConfig = Field(default_factory=JobsConfig, description="Video job store: retention and byte budget.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request validation limits.")
    controlnets: list[AddonConfig] = Field(
        default_factory=list, description="Served ControlNets; every worker serving their model holds them.")
    loras: list[LoraConfig] = Field(
        default_factory=list,
        description="Served LoRAs (any number): read into a node's LoRA store when a request first needs one, and "
                    "into a worker when it admits one.")
    lora_loading: LoraLoadingConfig = Field(default_factory=LoraLoadingConfig, description="How LoRAs load.")
    edit_cache: EditCacheConfig = Field(default_factory=EditCacheConfig,
                                        description="Cached activations of edited templates.")
    patch_cache: PatchCacheConfig = Field(default_factory=PatchCacheConfig,
                                          description="Reuse of a request's patches across steps (SD3).")
    controlnet_service: ControlNetServiceConfig = Field(
        default_factory=ControlNetServiceConfig, description="Where ControlNets run.")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted bearer tokens; with any key (here or in api_keys_env) every route but /health needs "
                    "one. Empty (and no api_keys_env) means auth is off.")
    api_keys_env: str | None = Field(
        default=None, description="Environment variable holding comma-separated bearer tokens (read at start).")
    metrics_api_keys: list[str] = Field(
        default_factory=list,
        description="Tokens for GET /metrics only (e.g. a Prometheus scraper's); empty: /metrics takes api_keys.")
    serve_metrics_export_ms: int | None = Field(
        default=1000, ge=1,
        description="How often each replica exports Ray Serve's own request metrics (the replica's and its handles' "
                    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS). Serve's default, 100 ms, is a 10 Hz loop in every replica "
                    "and handle that burns CPU while the app is idle; None keeps Serve's default.")
    serve_one_loop: bool = Field(
        default=True,
        description="Run the ingress's, router's and job store's calls, and their handles' request routing, on the "
                    "replica's own event loop (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and "
                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0, two of Ray Serve's throughput-optimized settings): "
                    "every call then skips two hand-offs between threads. Safe for these three because their "
                    "methods are async and never block; the text encoder and VAE decoder deployments, whose model "
                    "calls do, keep Serve's defaults. False: Serve's defaults everywhere.")

    def replica_env(self, control_plane: bool) -> dict[str, str]:
        """The Ray Serve settings a replica reads from its environment when its process starts (so
        they reach it only through its runtime_env). `control_plane`: the ingress, router or job
        store, not a model deployment."""
        env = {}
        if self.serve_metrics_export_ms is not None:
            env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] = str(self.serve_metrics_export_ms)
        if self.serve_one_loop and control_plane:
            env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] = "0"
            env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "0"
        return env

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        return models

    @model_validator(mode="after")
    def _check_sequencer_profiles(self) -> "AppConfig":
        served = {m.name for m in self.models}
        for model, height, width in self.vae_decoder.sequencer_tables():
            if model not in served:
                raise ValueError(f"vae_decoder.sequencer_profile: a profile of model {model!r} ({width}x{height}), "
                                 f"which is not served; served: {sorted(served)}")
        return self

    @model_validator(mode="after")
    def _check_addons(self) -> "AppConfig":
        for kind, addons in ((AddonKind.CONTROLNET, self.controlnets), (AddonKind.LORA, self.loras)):
            names = [(a.model, a.name) for a in addons]
            if len(set(names)) != len(names):
                raise ValueError(f"{kind.value} names must be unique per model: {names}")
            for addon in addons:
                model = self.model(addon.model)
                what = f"{kind.value} {addon.name!r}"
                if model is None:
                    raise ValueError(f"{what}: model {addon.model!r} is not served")
                if not family_class(model.family).takes_addons:
                    raise ValueError(f"{what}: model {model.name!r} ({model.family}) takes no ControlNets or LoRAs")
                addon.to_source(kind)  # preset xor path
                if addon.preset is not None and addon.preset != model.preset:
                    raise ValueError(f"{what}: preset {addon.preset!r} does not fit model {model.name!r} "
                                     f"(preset {model.preset!r})")
        return self

    def addon_sources(self) -> tuple[AddonSource, ...]:
        return tuple([a.to_source(AddonKind.CONTROLNET) for a in self.controlnets]
                     + [a.to_source(AddonKind.LORA) for a in self.loras])

    def pool_spec(self) -> "WorkerPoolSpec":
        """What every denoiser worker is built from, made once: the pool's own settings and what the
        other components' settings ask of a worker (decoding, encoding, add-ons, approximations)."""
        vd, te = self.vae_decoder, self.text_encoder
        return replace(
            self.workers.to_spec(), decode_images=vd.on_workers, decode_chunks=vd.chunks,
            sequencer=vd.sequencer_spec(),
            encode_text=te.on_workers,
            text_cache_size=te.cache_size, addons=self.addon_sources(), lora_join_by=self.lora_loading.join_by,
            lora_store_bytes=self.lora_loading.store_bytes, max_resident_loras=self.lora_loading.max_resident,
            preload_loras=self.lora_loading.preload, controlnet_stale=self.controlnet_service.stale,
            edit_cache=self.edit_cache.store_spec(), edit_cache_kind=self.edit_cache.cache,
            edit_cache_worker_bytes=self.edit_cache.worker_bytes,
            edit_cache_loading=self.edit_cache.planner(self.router.profiles), patch_cache=self.patch_cache.spec())

    def addon(self, kind: AddonKind, model: str, name: str) -> AddonConfig | None:
        addons = self.controlnets if kind is AddonKind.CONTROLNET else self.loras
        return next((a for a in addons if a.model == model and a.name == name), None)

    @field_validator("api_keys", "metrics_api_keys")
    @classmethod
    def _no_empty_keys(cls, keys: list[str]) -> list[str]:
        # An empty token would let every request with "Authorization: Bearer " through.
        if any(not k.strip() for k in keys):
            raise ValueError("API keys must not be empty or blank")
        return keys

    @model_validator(mode="after")
    def _check_keys(self) -> "AppConfig":
        if self.api_keys_env and not self.resolved_api_keys(only_env=True):
            raise ValueError(f"api_keys_env names {self.api_keys_env!r}, which is unset or holds no keys here: "
                             "refusing to start with auth configured but no key to check")
        if self.metrics_api_keys and not (self.api_keys or self.api_keys_env):
            raise ValueError("metrics_api_keys without api_keys would leave every other route open")
        return self

    def policy_options(self) -> dict[str, Any]:
        """The policy's options as the router builds it (GenServe, and the composed policy's
        spine, batch up to the workers' cap)."""
        options = options_for_workers(self.router.policy, self.router.policy_options, self.workers.max_batch_size,
                                      self.workers.pack_resolutions)
        if "sp_degrees" in options:
            options["sp_degrees"] = tuple(options["sp_degrees"])
        return options

    def model(self, name: str | None) -> ModelConfig | None:
        if name is None:
            return self.models[0]
        return next((m for m in self.models if m.name == name), None)

    def resolved_api_keys(self, only_env: bool = False) -> tuple[str, ...]:
        keys = [] if only_env else list(self.api_keys)
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        return tuple(keys)
