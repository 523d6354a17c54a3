"""`stepserve generate` in this process: one image request through the engine a denoiser worker
runs, with no Ray cluster and no Serve app, so the picture equals the one the server returns for
the same request and seed.

The request is validated as the ingress validates it (`deployments.validation.to_specs`). The
model's family is loaded whole, as on a worker that encodes prompts and decodes images itself
(`text_encoder.on_workers`, `vae_decoder.on_workers`); its prompts are encoded as that worker
encodes them, and a `StepRunner` runs one `WorkerPlan` per denoising step, as the router would
send them, the last one finishing the request into the PNG the worker would return.

A plain prompt needs no ControlNet or LoRA, so none is loaded; nor are the approximations a config
may switch on for serving (patch cache, cached edits): this path is always the exact one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from stepserve.deployments.errors import APIError

# The config and validation modules import the engine (torch, diffusers, transformers): they
# load inside the functions, after `quiet_libraries` has silenced what warns as it loads.
if TYPE_CHECKING:
    from stepserve.deployments.config import AppConfig, ModelConfig
    from stepserve.engine.families import DiffusionFamily
    from stepserve.policies.types import RequestSpec

WORKER_ID = "oneshot"
# Auth guards the HTTP edge, which this path has none of; an `api_keys_env` that is unset here
# must not stop a local picture (the config validator refuses it for a server).
EDGE_ONLY = ("api_keys", "api_keys_env", "metrics_api_keys")

Progress = Callable[[int, int], None]  # (steps done, steps in all), after every step


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within it, no cyclic garbage collection: importing torch, diffusers and transformers builds
    some 400,000 objects that live to the end, and the collector's full passes over them while they
    pile up cost 0.5-1 s on a 2-core box, to free next to nothing (one request makes little cyclic
    garbage). On leaving, the collector is as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Within it, no Python warning, nor diffusers' or transformers' log lines (but errors) and
    progress bars: a one-shot run prints its own progress bar and one line, nothing else. Enter it
    before the engine is imported: transformers warns while diffusers imports it. On leaving, all
    is as it was (the command may run inside another program, a test)."""
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        from transformers.utils import logging as transformers_logging

        stack.enter_context(_quiet(transformers_logging))
        from diffusers.utils import logging as diffusers_logging  # imports transformers' models: after

        stack.enter_context(_quiet(diffusers_logging))
        ours = logging.getLogger("stepserve")
        stack.callback(ours.setLevel, ours.level)
        ours.setLevel(logging.ERROR)
        yield


@contextlib.contextmanager
def _quiet(library: Any) -> Iterator[None]:
    """A Hugging Face library's `utils.logging` at errors only and without progress bars, then back."""
    verbosity, bars = library.get_verbosity(), library.is_progress_bar_enabled()
    library.set_verbosity_error()
    library.disable_progress_bar()
    try:
        yield
    finally:
        library.set_verbosity(verbosity)
        if bars:
            library.enable_progress_bar()


def app_config(config: dict[str, Any]) -> AppConfig:
    """The Serve YAML's application arguments, as the app builder validates them, less auth."""
    from stepserve.deployments.config import AppConfig

    args = {k: v for k, v in (config["applications"][0].get("args") or {}).items() if k not in EDGE_ONLY}
    return AppConfig.model_validate(args)


def validate(app: AppConfig, request: dict[str, Any]) -> RequestSpec:
    """The request's one spec, exactly as the server would build it; raises `APIError` as the
    server would answer, or when the model is not one this path can serve."""
    from stepserve.deployments.validation import to_specs
    from stepserve.policies.types import RequestKind

    name = request.get("model")
    model = app.model(name)
    # Without a name the server picks the first image model, as `to_specs` does below.
    if name is not None and model is not None and model.kind is not RequestKind.T2I:
        raise APIError(400, f"model {model.name!r} ({model.family}) is not a text-to-image model, which is all "
                            "`stepserve generate` makes in process; serve it with `stepserve serve CONFIG` and "
                            "send it the request (videos: POST /v1/videos)", param="model", code="unsupported_model")
    (spec,) = to_specs({**request, "n": 1}, app, f"cli-{uuid.uuid4().hex[:12]}")
    return spec


def generate(app: AppConfig, spec: RequestSpec, progress: Progress | None = None) -> bytes:
    """The spec's PNG: its model loaded and run on the device the config gives its workers."""
    import torch

    workers = app.workers
    threads = torch.get_num_threads()
    # A worker's own thread count when the config sets one (the same numerics as the server's);
    # else every core: nothing else runs here.
    torch.set_num_threads(workers.torch_threads or os.cpu_count() or 1)
    try:
        from stepserve.engine.families import resolve_device

        return run_request(load_model(app.model(spec.model), resolve_device(workers.device)), spec, progress)
    finally:
        torch.set_num_threads(threads)


def load_model(model: ModelConfig, device: str) -> DiffusionFamily:
    """The model's text encoder, denoiser and VAE, built or read exactly as its workers load them."""
    from stepserve.engine.families import ALL_PARTS, family_class

    return family_class(model.family).load(model.to_source(), ALL_PARTS, device)


def run_request(family: DiffusionFamily, spec: RequestSpec, progress: Progress | None = None) -> bytes:
    """The PNG of `spec` on `family`: encoded, stepped and decoded by the worker's own code, one
    plan per step, as a router sends them, so `progress` sees each step."""
    from stepserve.engine.step_runner import Admission, StepRunner
    from stepserve.engine.text_encoding import encode_conditioning
    from stepserve.policies.types import StepGroup, WorkerPlan

    rid = spec.request_id
    runner = StepRunner(WORKER_ID, {spec.model: family}, decode_images=True)

    def execute(plan: WorkerPlan, admissions: dict[str, Admission]) -> tuple[int, int, list[Any]]:
        report, payloads = runner.execute(plan, admissions)
        if report.failed:
            raise RuntimeError(report.failed[0].message)
        (state,) = report.progress
        return state.steps_done, state.steps_total, payloads

    # Admitted alone first: its sampler says how many steps it runs (a second-order scheduler may
    # run more timesteps than `num_inference_steps`).
    admission = Admission(spec, conditioning=encode_conditioning(family, spec))
    _, total, _ = execute(WorkerPlan(WORKER_ID, admit=(rid,), plan_id=1), {rid: admission})
    group = (StepGroup((rid,)),)
    for step in range(1, total + 1):
        finish = (rid,) if step == total else ()
        done, _, payloads = execute(WorkerPlan(WORKER_ID, groups=group, finish=finish, plan_id=step + 1), {})
        if progress is not None:
            progress(done, total)
    return payloads[0]
