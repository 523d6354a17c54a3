"""Workloads: which requests arrive when. One spec drives a live run and a simulated one.

A `WorkloadSpec` is a frozen value (an arrival process, a weighted mix of request classes, an
SLO scale, a length and a seed), usually read from a YAML file in `load_tests/workloads/`
(format: load_tests/README.md). `generate(spec, cost)` turns it into the requests of one run,
in send order. Pure Python and deterministic by seed: two policies, or a live run and a
simulated one, get exactly the same requests at exactly the same offsets.

Arrival times and the request mix come from two independent random streams, so the same seed
at another rate (`spec.with_rate(r)`) draws the same sequence of requests, only closer together
or further apart: a load sweep compares like with like.

`PoissonWorkload` is the older one-class form the live batching benchmark builds from flags;
`generate` accepts it too.
"""

from __future__ import annotations

import csv
import math
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stepserve.load_tests.addon_mix import control_image_b64

DEFAULT_PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk"
WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"


class WorkloadError(ValueError):
    """A workload spec is malformed; the message says where and what to fix."""


class SoloCost(Protocol):
    """The part of a cost model (`stepserve.policies.cost_model.CostModel`) a workload needs."""

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float: ...


# -- arrival processes -----------------------------------------------------------------------


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise WorkloadError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class PoissonArrivals:
    """Exponential gaps: the count in any window is Poisson (PatchedServe §8, SynerDiff §IV-A)."""

    rate: float  # requests per second

    def __post_init__(self) -> None:
        _positive("arrival.rate", self.rate)

    def scaled(self, factor: float) -> PoissonArrivals:
        return replace(self, rate=self.rate * factor)


@dataclass(frozen=True)
class GammaArrivals:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv`: cv = 1 is
    Poisson, cv > 1 is burstier (clustered arrivals), cv < 1 more regular."""

    rate: float
    cv: float

    def __post_init__(self) -> None:
        _positive("arrival.rate", self.rate)
        _positive("arrival.cv", self.cv)

    def scaled(self, factor: float) -> GammaArrivals:
        return replace(self, rate=self.rate * factor)


@dataclass(frozen=True)
class BurstArrivals:
    """Poisson at `base_rate`, except `burst_rate` from `burst_start_s` for `burst_duration_s`
    (SynerDiff §IV-A: half of all tasks dispatched within a short interval)."""

    base_rate: float
    burst_rate: float
    burst_start_s: float
    burst_duration_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_rate) and self.base_rate >= 0):
            raise WorkloadError(f"arrival.base_rate must be >= 0, got {self.base_rate!r}")
        _positive("arrival.burst_rate", self.burst_rate)
        if not (math.isfinite(self.burst_start_s) and self.burst_start_s >= 0):
            raise WorkloadError(f"arrival.burst_start_s must be >= 0, got {self.burst_start_s!r}")
        _positive("arrival.burst_duration_s", self.burst_duration_s)

    @property
    def burst_end_s(self) -> float:
        return self.burst_start_s + self.burst_duration_s

    def rate_at(self, t: float) -> float:
        return self.burst_rate if self.burst_start_s <= t < self.burst_end_s else self.base_rate

    def expected_count(self, t: float) -> float:
        """Expected arrivals in [0, t)."""
        inside = max(0.0, min(t, self.burst_end_s) - self.burst_start_s)
        return self.burst_rate * inside + self.base_rate * (t - inside)

    def scaled(self, factor: float) -> BurstArrivals:
        return replace(self, base_rate=self.base_rate * factor, burst_rate=self.burst_rate * factor)


@dataclass(frozen=True)
class TraceRow:
    offset_s: float
    # Per-request fields the trace fixes (model, width, height, steps, guidance_scale, prompt,
    # negative_prompt, slo_s); the rest are drawn from the mix.
    fields: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class TraceArrivals:
    """Replay of recorded offsets (a CSV, read when the spec is loaded), stretched by
    `time_scale` (> 1 slows the trace down)."""

    rows: tuple[TraceRow, ...]
    time_scale: float = 1.0
    source: str = ""  # the CSV path, for reports

    def __post_init__(self) -> None:
        if not self.rows:
            raise WorkloadError("arrival: the trace has no rows")
        _positive("arrival.time_scale", self.time_scale)
        offsets = [r.offset_s for r in self.rows]
        if any(o < 0 or not math.isfinite(o) for o in offsets):
            raise WorkloadError("arrival: trace offsets must be finite and >= 0")
        if any(b < a for a, b in zip(offsets, offsets[1:])):
            raise WorkloadError("arrival: trace offsets must not decrease")

    def scaled(self, factor: float) -> TraceArrivals:
        return replace(self, time_scale=self.time_scale / factor)


Arrivals = Union[PoissonArrivals, GammaArrivals, BurstArrivals, TraceArrivals]


# -- the request mix -------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeChoice:
    width: int
    height: int
    weight: float = 1.0


@dataclass(frozen=True)
class StepsChoice:
    """Either uniform over `choices`, or uniform over the integers `low..high` (inclusive)."""

    choices: tuple[int, ...] = ()
    low: int | None = None
    high: int | None = None

    def __post_init__(self) -> None:
        ranged = self.low is not None or self.high is not None
        if ranged == bool(self.choices):
            raise WorkloadError("steps: give either a list of step counts or {min, max}")
        if ranged:
            if self.low is None or self.high is None or not 1 <= self.low <= self.high:
                raise WorkloadError(f"steps: need 1 <= min <= max, got min={self.low} max={self.high}")
        elif any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.choices):
            raise WorkloadError(f"steps: step counts must be positive ints, got {list(self.choices)}")

    def draw(self, rng: random.Random) -> int:
        if self.choices:
            return self.choices[rng.randrange(len(self.choices))]
        return rng.randint(self.low, self.high)

    @property
    def values(self) -> tuple[int, ...]:
        return self.choices or tuple(range(self.low, self.high + 1))


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in the mix. CFG is on when guidance_scale > 1 (diffusers' rule)."""

    name: str
    model: str | None  # None: the server's default model (live only; the simulator needs a name)
    sizes: tuple[SizeChoice, ...]
    steps: StepsChoice
    weight: float = 1.0
    guidance_scale: float = 7.5
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str = ""
    # Each request's prompt made distinct (index appended), so the text encoder's cache never
    # hits: models prompt-diverse traffic (DiffusionDB). Off: every request repeats `prompt`.
    unique_prompts: bool = False
    slo_scale: float | None = None  # overrides the workload's σ for this class
    num_frames: int | None = None  # set: a text-to-video class (POST /v1/videos); None: images
    fps: int = 16  # videos only
    step_cache: float = 0.0  # each request's step-cache threshold (`step_cache` in the body); 0: exact

    def __post_init__(self) -> None:
        where = f"classes[{self.name}]"
        if not (math.isfinite(self.step_cache) and self.step_cache >= 0):
            raise WorkloadError(f"{where}.step_cache must be a finite threshold >= 0, got {self.step_cache!r}")
        if self.step_cache and self.num_frames is not None:
            raise WorkloadError(f"{where}.step_cache: videos have no step cache")
        if self.num_frames is not None and (isinstance(self.num_frames, bool) or self.num_frames < 1):
            raise WorkloadError(f"{where}.num_frames must be a positive int, got {self.num_frames!r}")
        if not self.sizes:
            raise WorkloadError(f"{where}.sizes: give at least one size")
        for size in self.sizes:
            if size.width < 8 or size.height < 8 or size.width % 8 or size.height % 8:
                raise WorkloadError(f"{where}.sizes: sides must be multiples of 8 and >= 8, got "
                                    f"{size.width}x{size.height}")
            _positive(f"{where}.sizes weight", size.weight)
        _positive(f"{where}.weight", self.weight)
        if not (math.isfinite(self.guidance_scale) and self.guidance_scale >= 0):
            raise WorkloadError(f"{where}.guidance_scale must be >= 0, got {self.guidance_scale!r}")
        if self.slo_scale is not None:
            _positive(f"{where}.slo_scale", self.slo_scale)

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale > 1.0


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: Arrivals
    classes: tuple[RequestClass, ...]
    duration_s: float | None = None  # arrivals stop at this offset ...
    num_requests: int | None = None  # ... or after this many (a trace may give neither)
    # σ: a request meets its SLO when its latency is at most σ × its solo latency (the cost
    # model's, PatchedServe §8 / GenServe). None: no SLO.
    slo_scale: float | None = None
    seed: int = 0
    name: str = "workload"
    description: str = ""

    def __post_init__(self) -> None:
        if not self.classes:
            raise WorkloadError("classes: give at least one request class")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise WorkloadError(f"classes: names must be unique, got {names}")
        if self.duration_s is not None:
            _positive("duration_s", self.duration_s)
        if self.num_requests is not None and (isinstance(self.num_requests, bool) or self.num_requests < 1):
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests!r}")
        if not isinstance(self.arrival, TraceArrivals) and self.duration_s is None and self.num_requests is None:
            raise WorkloadError("give duration_s or num_requests (or both: whichever ends first)")
        if self.slo_scale is not None:
            _positive("slo_scale", self.slo_scale)

    @property
    def mean_rate(self) -> float:
        """The offered load in requests per second, averaged over the run."""
        a = self.arrival
        if isinstance(a, (PoissonArrivals, GammaArrivals)):
            return a.rate
        if isinstance(a, TraceArrivals):
            offsets = [r.offset_s * a.time_scale for r in a.rows[: self.num_requests]]
            if self.duration_s is not None:
                offsets = [o for o in offsets if o < self.duration_s]
            span = self.duration_s if self.duration_s is not None else (offsets[-1] if offsets else 0.0)
            if not offsets or span <= 0:
                raise WorkloadError("the trace's mean rate is undefined (no rows, or all at offset 0)")
            return len(offsets) / span
        # Burst: average over the run's expected length.
        horizon = self.duration_s if self.duration_s is not None else _burst_time_for(a, self.num_requests)
        if self.duration_s is not None and self.num_requests is not None:
            horizon = min(horizon, _burst_time_for(a, self.num_requests))
        return a.expected_count(horizon) / horizon

    def with_rate(self, rate: float) -> WorkloadSpec:
        """The same workload at another mean rate: every rate (or the trace's clock) scaled."""
        _positive("rate", rate)
        return replace(self, arrival=self.arrival.scaled(rate / self.mean_rate))


def _burst_time_for(a: BurstArrivals, count: int) -> float:
    """When the expected arrival count reaches `count`."""
    before = a.base_rate * a.burst_start_s
    if count <= before:
        return count / a.base_rate
    during = before + a.burst_rate * a.burst_duration_s
    if count <= during or a.base_rate == 0:
        return a.burst_start_s + min(count - before, during - before) / a.burst_rate
    return a.burst_end_s + (count - during) / a.base_rate


# -- the requests of one run -----------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledRequest:
    index: int
    offset_s: float  # send time, seconds after the run starts
    num_inference_steps: int
    seed: int
    width: int
    height: int
    guidance_scale: float
    prompt: str
    model: str | None = None  # None: the server's default model
    negative_prompt: str = ""
    slo_s: float | None = None  # allowed latency from offset_s; None when the run has no SLO
    request_class: str = ""
    num_frames: int | None = None  # a video request when set
    fps: int = 16
    controlnets: tuple[str, ...] = ()  # ControlNet names (`addon_mix.with_addons`), each with a control image
    loras: tuple[str, ...] = ()  # LoRA names
    step_cache: float = 0.0  # its step-cache threshold (0: exact)
    # The body carries `slo_s`: the server holds the request to its own objective (a mix whose
    # sizes or kinds differ in solo latency), not to its model's.
    send_slo: bool = False

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def is_video(self) -> bool:
        return self.num_frames is not None

    def body(self) -> dict[str, Any]:
        """The JSON body of `POST /v1/images/generations`, or of `POST /v1/videos` for a video
        request (a fresh dict each call)."""
        body: dict[str, Any] = {
            "prompt": self.prompt, "size": f"{self.width}x{self.height}",
            "num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
            "seed": self.seed,
        }
        if self.is_video:
            body.update(num_frames=self.num_frames, fps=self.fps)
        else:
            body["n"] = 1
        if self.model is not None:
            body["model"] = self.model
        if self.negative_prompt:
            body["negative_prompt"] = self.negative_prompt
        if self.controlnets:
            body["controlnets"] = [{"name": name, "image": control_image_b64(name, self.width, self.height)}
                                   for name in self.controlnets]
        if self.loras:
            body["loras"] = [{"name": name} for name in self.loras]
        if self.step_cache:
            body["step_cache"] = self.step_cache
        if self.send_slo and self.slo_s is not None:
            body["slo_s"] = self.slo_s
        return body

    def files(self) -> dict[str, tuple[str, bytes, str]] | None:
        """The multipart files of a request sent to `POST /v1/images/edits` with `body()` as its
        fields (`edit_workload.ScheduledEdit`); None for a JSON request."""
        return None


@dataclass(frozen=True)
class PoissonWorkload:
    """One class of requests at Poisson arrivals; what `bench_batching` builds from its flags."""

    rate: float  # mean arrivals per second
    duration_s: float | None = None  # arrivals stop at this offset ...
    num_requests: int | None = None  # ... or after this many (exactly one of the two)
    steps_choices: tuple[int, ...] = (10, 20, 40)  # each request draws one, uniformly
    width: int = 128
    height: int = 128
    guidance_scale: float = 7.5
    prompt: str = DEFAULT_PROMPT
    seed: int = 0
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration_s or num_requests")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.steps_choices or any(s < 1 for s in self.steps_choices):
            raise ValueError(f"steps_choices must be positive step counts, got {self.steps_choices}")

    def to_spec(self) -> WorkloadSpec:
        request_class = RequestClass(
            name="default", model=self.model, sizes=(SizeChoice(self.width, self.height),),
            steps=StepsChoice(choices=tuple(self.steps_choices)), guidance_scale=self.guidance_scale,
            prompt=self.prompt,
        )
        return WorkloadSpec(arrival=PoissonArrivals(self.rate), classes=(request_class,), duration_s=self.duration_s,
                            num_requests=self.num_requests, seed=self.seed, name="poisson")


def generate(workload: WorkloadSpec | PoissonWorkload, cost: SoloCost | None = None) -> list[ScheduledRequest]:
    """The requests of one run, in send order.

    With a cost model and an SLO scale σ, each request gets `slo_s = σ × solo latency` of its
    model, size, steps and CFG mode; a trace's `slo_s` column wins over both.
    """
    spec = workload.to_spec() if isinstance(workload, PoissonWorkload) else workload
    arrival_rng = random.Random(f"{spec.seed}:arrivals")
    mix_rng = random.Random(f"{spec.seed}:mix")
    class_weights = [c.weight for c in spec.classes]
    solo_cache: dict[tuple, float] = {}
    requests: list[ScheduledRequest] = []
    for offset, fixed in _arrivals(spec, arrival_rng):
        # Draw order is fixed (class, size, steps, seed) so a seed always means the same requests,
        # and every draw is made even when the trace fixes the field, so traces with and without
        # a column stay aligned.
        request_class = spec.classes[_weighted_index(mix_rng, class_weights)]
        size = request_class.sizes[_weighted_index(mix_rng, [s.weight for s in request_class.sizes])]
        steps = request_class.steps.draw(mix_rng)
        seed = mix_rng.randrange(2**31)
        index = len(requests)
        prompt = request_class.prompt + (f" #{index}" if request_class.unique_prompts else "")
        values: dict[str, Any] = dict(
            model=request_class.model, width=size.width, height=size.height, num_inference_steps=steps,
            guidance_scale=request_class.guidance_scale, prompt=prompt,
            negative_prompt=request_class.negative_prompt, step_cache=request_class.step_cache,
        )
        if request_class.num_frames is not None:
            values.update(num_frames=request_class.num_frames, fps=request_class.fps)
        values.update(fixed)
        slo = values.pop("slo_s", None)
        scale = request_class.slo_scale if request_class.slo_scale is not None else spec.slo_scale
        if slo is None and scale is not None and cost is not None:
            if values["model"] is None:
                raise WorkloadError(f"class {request_class.name!r} has no model, so its solo latency is unknown")
            frames = values.get("num_frames") or 1
            key = (values["model"], values["height"], values["width"], values["num_inference_steps"],
                   values["guidance_scale"] > 1.0, frames)
            if key not in solo_cache:
                solo_cache[key] = cost.solo_seconds(*key[:5], frames=frames)
            slo = scale * solo_cache[key]
        requests.append(ScheduledRequest(index=index, offset_s=offset, seed=seed, slo_s=slo,
                                         request_class=request_class.name, **values))
    return requests


def _weighted_index(rng: random.Random, weights: Sequence[float]) -> int:
    if len(weights) == 1:
        return 0
    x = rng.random() * sum(weights)
    for i, w in enumerate(weights):
        x -= w
        if x < 0:
            return i
    return len(weights) - 1


def _arrivals(spec: WorkloadSpec, rng: random.Random) -> Iterator[tuple[float, dict[str, Any]]]:
    """(offset, fields fixed by a trace) in order, until the duration or count is reached."""
    a = spec.arrival
    count = 0
    for offset, fixed in _offsets(a, rng):
        if spec.num_requests is not None and count >= spec.num_requests:
            return
        if spec.duration_s is not None and offset >= spec.duration_s:
            return
        count += 1
        yield offset, fixed


def _offsets(a: Arrivals, rng: random.Random) -> Iterator[tuple[float, dict[str, Any]]]:
    if isinstance(a, TraceArrivals):
        for row in a.rows:
            yield row.offset_s * a.time_scale, dict(row.fields)
        return
    t = 0.0
    if isinstance(a, PoissonArrivals):
        while True:
            t += rng.expovariate(a.rate)
            yield t, {}
    if isinstance(a, GammaArrivals):
        shape = 1.0 / (a.cv * a.cv)
        while True:
            t += rng.gammavariate(shape, 1.0 / (a.rate * shape))
            yield t, {}
    # Piecewise-constant Poisson: exponential gaps at the current rate; a gap that crosses a
    # rate change is redrawn from the change (memorylessness makes that exact).
    boundaries = (a.burst_start_s, a.burst_end_s)
    while True:
        rate = a.rate_at(t)
        nxt = next((b for b in boundaries if b > t), math.inf)
        if rate == 0:
            if nxt == math.inf:
                return
            t = nxt
            continue
        gap = rng.expovariate(rate)
        if t + gap >= nxt:
            t = nxt
            continue
        t += gap
        yield t, {}


# -- YAML (pydantic lives only here, at the edge) --------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _PoissonYaml(_Strict):
    process: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")


class _GammaYaml(_Strict):
    process: Literal["gamma"]
    rate: float = Field(gt=0)
    cv: float = Field(gt=0, description="coefficient of variation of the gaps; 1 = Poisson")


class _BurstYaml(_Strict):
    process: Literal["burst"]
    base_rate: float = Field(ge=0)
    burst_rate: float = Field(gt=0)
    burst_start_s: float = Field(ge=0)
    burst_duration_s: float = Field(gt=0)


class _TraceYaml(_Strict):
    process: Literal["trace"]
    path: str = Field(description="CSV with an offset_s column; relative to the YAML file")
    time_scale: float = Field(default=1.0, gt=0)


_SizeYaml = Union[str, int, dict]


class _ClassYaml(_Strict):
    name: str
    model: str | None = None
    weight: float = Field(default=1.0, gt=0)
    sizes: list[_SizeYaml] = Field(min_length=1)
    steps: Union[int, list[int], dict]
    guidance_scale: float = Field(default=7.5, ge=0)
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str = ""
    unique_prompts: bool = False
    slo_scale: float | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, ge=1)
    fps: int = Field(default=16, ge=1)
    step_cache: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class _WorkloadYaml(_Strict):
    name: str | None = None
    description: str = ""
    seed: int = 0
    duration_s: float | None = Field(default=None, gt=0)
    num_requests: int | None = Field(default=None, ge=1)
    slo_scale: float | None = Field(default=None, gt=0)
    arrival: Union[_PoissonYaml, _GammaYaml, _BurstYaml, _TraceYaml] = Field(discriminator="process")
    classes: list[_ClassYaml] = Field(min_length=1)

    @field_validator("classes")
    @classmethod
    def _unique(cls, classes: list[_ClassYaml]) -> list[_ClassYaml]:
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")
        return classes


def parse_size(value: Any, where: str) -> SizeChoice:
    """'512x768' (width x height), 512 (square), or {size: ..., weight: ...}."""
    weight = 1.0
    if isinstance(value, Mapping):
        unknown = set(value) - {"size", "weight"}
        if unknown or "size" not in value:
            raise WorkloadError(f"{where}: a size entry is {{size: WxH, weight: w}}, got {dict(value)}")
        weight = value.get("weight", 1.0)
        value = value["size"]
    if isinstance(value, bool):
        raise WorkloadError(f"{where}: bad size {value!r}")
    if isinstance(value, int):
        return SizeChoice(value, value, weight)
    if isinstance(value, str):
        parts = value.lower().split("x")
        try:
            width, height = (int(p) for p in parts) if len(parts) == 2 else (int(parts[0]),) * 2
        except ValueError:
            raise WorkloadError(f"{where}: size must look like '512x768' or 512, got {value!r}") from None
        return SizeChoice(width, height, weight)
    raise WorkloadError(f"{where}: size must look like '512x768' or 512, got {value!r}")


def parse_steps(value: Any, where: str) -> StepsChoice:
    """20, [20, 30, 50] (uniform choice) or {min: 20, max: 50} (uniform integer range)."""
    if isinstance(value, bool):
        raise WorkloadError(f"{where}: bad steps {value!r}")
    if isinstance(value, int):
        return StepsChoice(choices=(value,))
    if isinstance(value, list):
        return StepsChoice(choices=tuple(value))
    if isinstance(value, Mapping) and set(value) == {"min", "max"}:
        return StepsChoice(low=value["min"], high=value["max"])
    raise WorkloadError(f"{where}: steps is an int, a list of ints or {{min, max}}, got {value!r}")


TRACE_FIELDS = {
    "model": str, "width": int, "height": int, "steps": int, "guidance_scale": float, "prompt": str,
    "negative_prompt": str, "slo_s": float,
}


def read_trace(path: str | os.PathLike) -> tuple[TraceRow, ...]:
    """A CSV with `offset_s` and, optionally, the columns in TRACE_FIELDS (or `size` as WxH);
    an empty cell means "draw this field from the mix"."""
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        if "offset_s" not in columns:
            raise WorkloadError(f"{path}: a trace needs an offset_s column, found {columns}")
        unknown = [c for c in columns if c not in TRACE_FIELDS and c not in ("offset_s", "size")]
        if unknown:
            raise WorkloadError(f"{path}: unknown trace column(s) {unknown}; known: offset_s, size, "
                                f"{', '.join(TRACE_FIELDS)}")
        for raw in reader:
            where = f"{path}:{reader.line_num}"
            try:
                offset = float(raw["offset_s"])
                fields: dict[str, Any] = {}
                for column, text in raw.items():
                    if column == "offset_s" or text is None or text.strip() == "":
                        continue
                    if column == "size":
                        size = parse_size(text.strip(), where)
                        fields["width"], fields["height"] = size.width, size.height
                    else:
                        fields[column] = TRACE_FIELDS[column](text.strip())
            except ValueError as exc:
                raise WorkloadError(f"{where}: {exc}") from None
            if "steps" in fields:
                fields["num_inference_steps"] = fields.pop("steps")
            rows.append(TraceRow(offset, tuple(sorted(fields.items()))))
    return tuple(rows)


def parse_workload(data: Any, base_dir: str | os.PathLike = ".", name: str = "workload") -> WorkloadSpec:
    """A workload from parsed YAML; every error is a WorkloadError naming the field."""
    try:
        raw = _WorkloadYaml.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise WorkloadError(f"workload {name!r}: {problems}") from None
    a = raw.arrival
    arrival: Arrivals
    if isinstance(a, _PoissonYaml):
        arrival = PoissonArrivals(a.rate)
    elif isinstance(a, _GammaYaml):
        arrival = GammaArrivals(a.rate, a.cv)
    elif isinstance(a, _BurstYaml):
        arrival = BurstArrivals(a.base_rate, a.burst_rate, a.burst_start_s, a.burst_duration_s)
    else:
        path = Path(a.path) if Path(a.path).is_absolute() else Path(base_dir) / a.path
        if not path.exists():
            raise WorkloadError(f"workload {name!r}: arrival.path: no trace file {str(path)!r}")
        arrival = TraceArrivals(read_trace(path), a.time_scale, str(path))
    classes = tuple(
        RequestClass(
            name=c.name, model=c.model, weight=c.weight,
            sizes=tuple(parse_size(s, f"classes[{c.name}].sizes") for s in c.sizes),
            steps=parse_steps(c.steps, f"classes[{c.name}].steps"), guidance_scale=c.guidance_scale,
            prompt=c.prompt, negative_prompt=c.negative_prompt, unique_prompts=c.unique_prompts,
            slo_scale=c.slo_scale, num_frames=c.num_frames, fps=c.fps, step_cache=c.step_cache,
        )
        for c in raw.classes
    )
    try:
        return WorkloadSpec(arrival=arrival, classes=classes, duration_s=raw.duration_s,
                            num_requests=raw.num_requests, slo_scale=raw.slo_scale, seed=raw.seed,
                            name=raw.name or name, description=raw.description.strip())
    except WorkloadError as exc:
        raise WorkloadError(f"workload {name!r}: {exc}") from None


def load_workload(path_or_name: str | os.PathLike) -> WorkloadSpec:
    """A YAML path, or the name of a shipped workload ("synerdiff-mixed")."""
    path = Path(path_or_name)
    if not path.exists() and path.suffix not in (".yaml", ".yml"):
        shipped = WORKLOADS_DIR / f"{path_or_name}.yaml"
        if not shipped.exists():
            known = sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))
            raise WorkloadError(f"no workload {str(path_or_name)!r}; shipped: {known}")
        path = shipped
    if not path.exists():
        raise WorkloadError(f"no workload file {str(path)!r}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise WorkloadError(f"{path}: not valid YAML: {exc}") from None
    return parse_workload(data, path.parent, path.stem)


def describe(spec: WorkloadSpec) -> dict[str, Any]:
    """A JSON-ready description of a spec, for reports."""
    a = spec.arrival
    if isinstance(a, TraceArrivals):
        arrival = {"process": "trace", "source": a.source, "rows": len(a.rows), "time_scale": a.time_scale}
    else:
        kind = {PoissonArrivals: "poisson", GammaArrivals: "gamma", BurstArrivals: "burst"}[type(a)]
        arrival = {"process": kind, **a.__dict__}
    return {
        "name": spec.name, "seed": spec.seed, "duration_s": spec.duration_s, "num_requests": spec.num_requests,
        "slo_scale": spec.slo_scale, "mean_rate": spec.mean_rate, "arrival": arrival,
        "classes": [
            {"name": c.name, "model": c.model, "weight": c.weight, "guidance_scale": c.guidance_scale,
             "sizes": [f"{s.width}x{s.height}:{s.weight:g}" for s in c.sizes],
             "steps": list(c.steps.choices) or {"min": c.steps.low, "max": c.steps.high},
             "unique_prompts": c.unique_prompts, "slo_scale": c.slo_scale}
            for c in spec.classes
        ],
    }
