"""Every approximation switch of the engine against the exact path, on the shapes models (a model
that draws something, and a judge that says whether it drew what the prompt asked): for each
switch at its default setting and at one more aggressive one, the PSNR and SSIM of each
approximate picture against the exact picture of the same request and seed, and the prompt
accuracy of the approximate pictures beside that of the exact ones.

Each picture is made as the server makes it (bench_shapes' `draw`: `StepRunner`, one batched
forward per step, the worker's decode and PNG rounding), with the switch set where the served path
sets it:

- patch statistics (PatchedServe §4): the patched UNet forward a 64 px image gets when it is packed
  with other resolutions (`workers.pack_resolutions`), cut into `--patch-px` patches, with
  per-image GroupNorm statistics (what is served) and with per-patch statistics (the paper's
  cheaper stitcher; no config serves it). Sampled as bench_patch_fidelity samples it.
- stale ControlNet (SwiftDiffusion §4.1): the ControlNet in its service (`controlnet_service`,
  in this process as the golden tests run it) with `stale` false and true, against the ControlNet
  run inline before the UNet (the default, with no service).
- late LoRA joins (SwiftDiffusion §4.2): `lora_loading.join_by` 0 and `--join-by`, the LoRA
  arriving only when the step runner waits for it (its deadline: the worst case the bound allows).
- CFG parallel (SwiftDiffusion §4.3, `router.policy: latent_parallel`): each request's two CFG
  rows on two ranks of a gloo group, two processes, as two workers run them. Off by default, where
  it is the exact path itself, so only the split is measured.
- step caching (First-Block Cache, `step_cache`): every request at the model's default (0: off)
  and at `--step-cache`; bench_step_cache measures its speed and more thresholds.
- skip-CFG (SynerDiff §IV, `skip_cfg_quality`): every request skipping its unconditional row from
  the model's default fraction of its steps (1: never) and from `--skip-cfg-from`;
  bench_skip_cfg measures its speed and the whole curve a quality threshold reads.
- patch cache (PatchedServe §5, `patch_cache`; families with forward mode `patch_cache`): each
  request reusing its patches' block outputs from its previous step where the reuse predictor
  allows, the predictor calibrated as a worker calibrates it at startup (at the requests' size and
  steps, as a config serving them sets `calibration_size` and `calibration_steps`), at the default
  `tolerance` and at `--patch-cache-tolerance`; the rows give the share of patch decisions reused.
- cached edits (InstGenIE §3.1, `edit_cache`; families with forward mode `template_edit`): each
  held-out picture is a template edited twice, recolouring its shape (`load_tests.shape_edits`):
  the first edit records the template's activations, the second (another colour and seed, the
  same mask) reuses them, against the second edit run exact; with each kind of record
  (`edit_cache.cache`). The rows give the share of image tokens the cached edits computed.

Rows of switches the model's family does not have say so (`not_applicable`); so does the patch
statistics row on a DiT (it packs tokens, exactly, and has no GroupNorm).

PSNR is over all pictures of a row at once (from their mean squared error: finite unless every
picture equals its exact one, and not swayed by the few that do); SSIM is the mean over pictures.

    python -m stepserve.load_tests.bench_fidelity --out docs/results/fidelity
    python -m stepserve.load_tests.bench_fidelity --model shapes-sd3 --out docs/results/fidelity-sd3

Writes fidelity.json and fidelity.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stepserve.engine.addons.source import LoraJoinBounds
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.shapes import dataset
from stepserve.engine.shapes.judge import Judge, prompt_accuracy
from stepserve.load_tests.bench_shapes import (
    HELD_OUT_SEED, add_drawing_arguments, controlled, draw, in_batches, load_served, specs_for,
)
from stepserve.load_tests.fidelity import psnr, ssim
from stepserve.load_tests.shape_edits import edit_requests, recoloured
from stepserve.policies.types import ControlNetUse, LoraUse, RequestSpec
from stepserve.runtime import load_serve_config

BATCH = 25  # requests denoised together, as bench_shapes batches them (batch shape changes float rounding)
RULE_SSIM = 0.9  # the bar for a default: SSIM at least this ...
RULE_POINTS = 3.0  # ... and prompt accuracy within this many points of exact


def batched(make: Callable[[list[RequestSpec]], np.ndarray], specs: Sequence[RequestSpec]) -> np.ndarray:
    return np.concatenate([make(list(specs[i:i + BATCH])) for i in range(0, len(specs), BATCH)])


class DueLoras:
    """A `LoraLoader` whose LoRAs arrive only when the step runner waits for them, at the deadline
    `join_by` sets: the latest a late LoRA may join, so the most the switch can cost."""

    def __init__(self, family, loras: dict):
        self.family, self.loras = family, loras

    def request(self, model: str, name: str) -> None:
        pass  # nothing arrives before it is waited for

    def poll(self) -> None:
        pass

    def wait(self, model: str, name: str) -> None:
        self.family.add_lora(self.loras[name])

    def trim(self, keep: set) -> None:
        pass


def joined_late(family, specs: Sequence[RequestSpec], join_by: float) -> np.ndarray:
    from stepserve.engine.step_runner import StepRunner

    loras = dict(family.loras)

    def batch(chunk: list[RequestSpec]) -> np.ndarray:
        for name in loras:  # gone again: each batch's requests start before their LoRA arrives
            family.remove_lora(name)
        runner = StepRunner("bench", {chunk[0].model: family}, decode_images=True,
                            modes=ModeSettings(loras=DueLoras(family, loras), lora_bounds=LoraJoinBounds(join_by)))
        return draw(family, chunk, runner=runner)

    try:
        return batched(batch, specs)
    finally:
        for lora in loras.values():
            family.add_lora(lora)


def patched(family, specs: Sequence[RequestSpec], patch_px: int, stats) -> np.ndarray:
    """Every step one patched UNet forward over the batch (`bench_patch_fidelity`), rounded as a
    finished image's PNG is."""
    from diffusers.image_processor import VaeImageProcessor

    from stepserve.load_tests.bench_patch_fidelity import denoise_patched

    def batch(chunk: list[RequestSpec]) -> np.ndarray:
        images = denoise_patched(family, chunk, patch_px // family.vae_scale_factor, stats)
        return np.stack([np.asarray(p) for p in VaeImageProcessor.numpy_to_pil(np.stack(images))])

    return batched(batch, specs)


def with_controlnet_service(family, app, model, stale: bool, specs, inputs) -> np.ndarray:
    from stepserve.actors.controlnet_client import InProcessControlNets
    from stepserve.deployments.controlnet_service import ControlNetService
    from stepserve.engine.addons.source import AddonKind

    sources = [c.to_source(AddonKind.CONTROLNET) for c in app.controlnets if c.model == model.name]
    from stepserve.engine.step_runner import StepRunner

    family.controlnet_service = InProcessControlNets(ControlNetService(sources, [model.to_source()], "cpu"))
    try:
        runner = StepRunner("bench", {model.name: family}, decode_images=True,
                            modes=ModeSettings(stale_controlnets=stale))
        return in_batches(family, specs, inputs, BATCH, runner=runner)
    finally:
        family.controlnet_service = None


def cfg_split(args: argparse.Namespace, specs: Sequence[RequestSpec]) -> tuple[np.ndarray, bool]:
    """The specs' pictures with each request's CFG rows on two processes (rank 0's), and whether
    both ranks' pictures are equal to the bit."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(split_rank, args=(2, folder, str(args.config), args.model, list(specs),
                                             max(1, args.threads // 2)), nprocs=2, join=True, start_method="spawn")
        pictures = [np.load(Path(folder) / f"rank{rank}.npy") for rank in range(2)]
    return pictures[0], bool(np.array_equal(*pictures))


def split_rank(rank: int, world_size: int, folder: str, config: str, model_name: str, specs: list[RequestSpec],
               threads: int) -> None:
    """One rank of the CFG split: the model loaded as a worker loads it, every request admitted,
    each step of each request one forward of its own row and an all-gather."""
    import torch
    import torch.distributed as dist

    from stepserve.engine.step_runner import StepRunner
    from stepserve.oneshot import app_config, load_model, quiet_libraries

    torch.set_num_threads(threads)
    with quiet_libraries():
        family = load_model(app_config(load_serve_config(config)).model(model_name), "cpu")
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
        try:
            group = dist.new_group(list(range(world_size)))
            runner = StepRunner(f"rank{rank}", {model_name: family}, decode_images=True)
            pictures = batched(lambda chunk: draw(family, chunk, runner=runner, split_over=group), specs)
        finally:
            dist.destroy_process_group()
    np.save(Path(folder) / f"rank{rank}.npy", pictures)


def kept_states(runner, mode: ModeName) -> list:
    """Every state `mode` gives a request `runner` admits (the states leave with their requests)."""
    states = []
    forward_mode = runner.modes[mode]
    admit = forward_mode.admit

    def keeping(sampler, family) -> None:
        admit(sampler, family)
        if sampler.mode is mode:
            states.append(sampler.mode_state)

    forward_mode.admit = keeping
    return states


def patch_cached(family, model: str, specs: Sequence[RequestSpec], spec) -> tuple[np.ndarray, float]:
    """The specs' pictures with the patch cache on, its reuse predictor calibrated as a worker
    calibrates it at startup (`engine.patch_cache.calibration.calibrate`, as `spec` says); and the
    share of all patch decisions that reused (PatchedServe Fig. 19's computation savings)."""
    from stepserve.engine.patch_cache.calibration import calibrate
    from stepserve.engine.step_runner import StepRunner

    reuse = calibrate(family, model, spec)
    runner = StepRunner("bench", {model: family}, decode_images=True, modes=ModeSettings(patch_reuse={model: reuse}))
    caches = kept_states(runner, ModeName.PATCH_CACHE)
    pictures = batched(lambda chunk: draw(family, chunk, runner=runner), specs)
    reused = sum(float(c.reused.sum()) for c in caches)
    return pictures, reused / sum(c.decided * len(c.reused) for c in caches)


def template_edited(family, model: str, first: list, second: list, kind) -> tuple[np.ndarray, float]:
    """The `second` edits' pictures with the edit cache on (`edit_cache.cache` = `kind`): the
    `first` edit of each template records its activations (exact), and the second one of the same
    template and mask reuses them; and the share of image tokens the second ones computed."""
    from stepserve.actors.activation_cache import ActivationCache
    from stepserve.engine.step_runner import StepRunner
    from stepserve.engine.template_edits import TemplateCache

    runner = StepRunner("bench", {model: family}, decode_images=True,
                        modes=ModeSettings(templates=TemplateCache(ActivationCache(memory_bytes=1 << 30), kind)))
    batched_edits(family, first, runner)
    edits = kept_states(runner, ModeName.TEMPLATE_EDIT)
    pictures = batched_edits(family, second, runner)
    if any(edit.records for edit in edits):
        raise RuntimeError("a second edit found no record of its template")
    tokens = (second[0][0].height // family.vae_scale_factor // family.patch_size) ** 2
    return pictures, float(np.mean([edit.index.shape[1] / tokens for edit in edits]))


def batched_edits(family, edits: list, runner=None) -> np.ndarray:
    """Pictures of (spec, inputs) edits, `BATCH` at a time, on `runner` (default: a plain worker's)."""
    return batched(lambda chunk: draw(family, [s for s, _ in chunk], [i for _, i in chunk], runner=runner), edits)


def compare(pictures: np.ndarray, exact: np.ndarray, scenes, judge: Judge, exact_accuracy: float) -> dict:
    a, b = pictures.astype(np.float64) / 255, exact.astype(np.float64) / 255
    pooled = psnr(a, b)  # over all pictures at once
    similarity = [ssim(x, y) for x, y in zip(a, b)]
    accuracy = prompt_accuracy(judge, pictures, scenes)
    points = 100 * (accuracy - exact_accuracy)
    mean_ssim = float(np.mean(similarity))
    return {
        "psnr_db": None if math.isinf(pooled) else pooled,  # None: every picture equals exact
        "ssim": mean_ssim, "ssim_min": float(np.min(similarity)),
        "identical": float(np.mean([np.array_equal(x, y) for x, y in zip(pictures, exact)])),
        "prompt_accuracy": accuracy, "exact_prompt_accuracy": exact_accuracy, "accuracy_change_points": points,
        "meets_rule": mean_ssim >= RULE_SSIM and abs(points) <= RULE_POINTS,
    }


def not_applicable(family, mode, what: str) -> str:
    """Why the model's family cannot run `what`: it lacks forward mode `mode`; names the families that have it."""
    from stepserve.engine.families import FAMILIES, family_class

    having = [name for name in FAMILIES if mode in family_class(name).forward_modes]
    return f"{family.source.family} has no {what} (forward mode {mode.value}; only {', '.join(having)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drawing_arguments(parser, prompts=100)
    parser.add_argument("--patch-px", type=int, default=32,
                        help="patch side of the patched forward, pixels (default: %(default)s, the cut of a 64 px "
                             "image packed with a 96 px one)")
    parser.add_argument("--join-by", type=float, default=0.4,
                        help="the aggressive lora_loading.join_by (default: %(default)s, SwiftDiffusion's bound: "
                             "step 20 of 50)")
    parser.add_argument("--step-cache", type=float, default=0.2,
                        help="the aggressive step_cache threshold (default: %(default)s, max_step_cache's default)")
    parser.add_argument("--skip-cfg-from", type=float, default=0.5,
                        help="the aggressive skip-CFG start, a fraction of the steps (default: %(default)s)")
    parser.add_argument("--patch-cache-tolerance", type=float, default=3e-2,
                        help="the aggressive patch_cache.tolerance (default: %(default)s)")
    parser.add_argument("--edit-strength", type=float, default=0.6,
                        help="the cached edits' strength (default: %(default)s: a recolour keeps the shape)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (each CFG rank gets half)")
    parser.add_argument("--out", type=Path, default=Path("results/fidelity"))
    args = parser.parse_args(argv)

    import torch
    from diffusers import UNet2DConditionModel

    from stepserve.deployments.config import EditCacheConfig, PatchCacheConfig
    from stepserve.engine.editing.masked_sd3 import CacheKind
    from stepserve.engine.patch_cache.calibration import PatchCacheSpec
    from stepserve.engine.patched import NormStats
    from stepserve.load_tests.plots import plot_fidelity
    from stepserve.oneshot import quiet_libraries
    from stepserve.profiling.common import log

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with quiet_libraries():
        app, model, family, judge = load_served(args)
        held_out = dataset.Renders(HELD_OUT_SEED, args.prompts)
        scenes = held_out.scenes
        prompts = [s.caption for s in scenes]
        silhouettes = controlled(held_out.silhouettes(np.arange(args.prompts)))
        plain = specs_for(prompts, args, "exact")
        rows: list[dict] = []
        seconds: dict[str, float] = {}

        def timed(name: str, make: Callable[[], Any]) -> Any:
            start = time.perf_counter()
            pictures = make()
            seconds[name] = round(time.perf_counter() - start, 1)
            log(f"{name}: {seconds[name]} s")
            return pictures

        def row(approximation: str, switch: str, setting: str, default: bool, pictures: np.ndarray,
                exact: np.ndarray, reference: str, scenes: Sequence[dataset.Scene] = scenes, **extra) -> None:
            """`scenes`: what the pictures should show (default: the held-out prompts')."""
            rows.append({"approximation": approximation, "switch": switch, "setting": setting, "default": default,
                         "reference": reference, **compare(pictures, exact, scenes, judge, accuracy[reference]),
                         **extra})

        exact = {"exact": timed("exact", lambda: in_batches(family, plain, batch=BATCH))}
        accuracy = {"exact": prompt_accuracy(judge, exact["exact"], scenes)}

        if isinstance(family.denoiser, UNet2DConditionModel):
            cut = f"{args.patch_px} px patches"
            for stats, default in ((NormStats.IMAGE, True), (NormStats.PATCH, False)):
                name = f"patch statistics {stats.value}"
                row("patch statistics", "GroupNorm statistics of the patched forward", f"per-{stats.value}, {cut}",
                    default, timed(name, lambda: patched(family, plain, args.patch_px, stats)), exact["exact"],
                    "exact")
        else:
            rows.append({"approximation": "patch statistics", "switch": "workers.pack_resolutions",
                         "not_applicable": f"{family.source.family} packs its images' tokens (exact), it has no "
                                           "GroupNorm to take statistics of"})

        if family.controlnets:
            cn = next(iter(family.controlnets))
            guided = specs_for(prompts, args, "cn", controlnets=(ControlNetUse(cn),))
            reference = f"exact, ControlNet {cn} inline"
            exact[reference] = timed(reference, lambda: in_batches(family, guided, silhouettes, BATCH))
            accuracy[reference] = prompt_accuracy(judge, exact[reference], scenes)
            for stale in (False, True):
                pictures = timed(f"controlnet service stale {stale}",
                                 lambda: with_controlnet_service(family, app, model, stale, guided, silhouettes))
                row("stale ControlNet", "controlnet_service.stale", f"{str(stale).lower()} (service)", not stale,
                    pictures, exact[reference], reference)

        if family.loras:
            lora = next(iter(family.loras))
            styled = specs_for(prompts, args, "lora", loras=(LoraUse(lora),))
            reference = f"exact, LoRA {lora}"
            exact[reference] = timed(reference, lambda: in_batches(family, styled, batch=BATCH))
            accuracy[reference] = prompt_accuracy(judge, exact[reference], scenes)
            for join_by in (0.0, args.join_by):
                pictures = timed(f"lora join_by {join_by:g}", lambda: joined_late(family, styled, join_by))
                joins = min(int(join_by * args.steps), args.steps - 1)  # `Sampler.lora_deadline`
                row("late LoRA join", "lora_loading.join_by", f"{join_by:g} (joins at step {joins} of {args.steps})",
                    join_by == 0.0, pictures, exact[reference], reference)

        for threshold in (0.0, args.step_cache):
            cached = [dataclasses.replace(spec, step_cache=threshold) for spec in plain]
            row("step caching", "step_cache", f"{threshold:g} (First-Block Cache)", threshold == 0.0,
                timed(f"step cache {threshold:g}", lambda: in_batches(family, cached, batch=BATCH)), exact["exact"],
                "exact")

        served_start = model.skip_cfg_from()
        for start in dict.fromkeys((served_start, args.skip_cfg_from)):
            skipping = [dataclasses.replace(spec, skip_cfg_from=start) for spec in plain]
            row("skip-CFG", "skip_cfg_quality", f"from {start:g} of the steps", start == served_start,
                timed(f"skip cfg from {start:g}", lambda: in_batches(family, skipping, batch=BATCH)), exact["exact"],
                "exact")

        split, ranks_agree = timed("cfg split", lambda: cfg_split(args, plain))
        row("CFG parallel", "router.policy", "latent_parallel (rows on 2 ranks)", False,
            split, exact["exact"], "exact", ranks_agree=ranks_agree)

        if ModeName.PATCH_CACHE in family.forward_modes:
            served = PatchCacheConfig()
            for tolerance in (served.tolerance, args.patch_cache_tolerance):
                spec = PatchCacheSpec(tolerance, served.side, served.full_steps, args.size, args.steps)
                pictures, share = timed(f"patch cache {tolerance:g}",
                                        lambda: patch_cached(family, model.name, plain, spec))
                row("patch cache", "patch_cache.tolerance", f"{tolerance:g} (patches of {spec.side}x{spec.side} "
                    f"tokens, calibrated at {args.size} px, {args.steps} steps)", False, pictures, exact["exact"],
                    "exact", reused=share)
        else:
            rows.append({"approximation": "patch cache", "switch": "patch_cache.enabled",
                         "not_applicable": not_applicable(family, ModeName.PATCH_CACHE, "patch cache")})

        if ModeName.TEMPLATE_EDIT in family.forward_modes:
            skipped = type(family).skipped_steps(args.steps, args.edit_strength)
            templates = held_out.pictures(np.arange(args.prompts))
            first, second = ([recoloured(scene, turn) for scene in scenes] for turn in (1, 2))
            first_edits, second_edits = (
                edit_requests(specs_for([s.caption for s in new], args, tag), scenes, templates, args.edit_strength,
                              skipped, template_ids=True) for new, tag in ((first, "first"), (second, "second")))
            reference = "exact, edits"
            exact[reference] = timed(reference, lambda: batched_edits(
                family, [(dataclasses.replace(spec, template_id=None), inputs) for spec, inputs in second_edits]))
            accuracy[reference] = prompt_accuracy(judge, exact[reference], second)
            for kind in (EditCacheConfig().cache, CacheKind.OUTPUTS):
                pictures, share = timed(f"cached edits {kind.value}", lambda: template_edited(
                    family, model.name, first_edits, second_edits, kind))
                row("cached edits", "edit_cache.cache", f"{kind.value} (second edit of each template)",
                    False, pictures, exact[reference], reference, scenes=second, computed_tokens=share)
        else:
            rows.append({"approximation": "cached edits", "switch": "edit_cache.enabled",
                         "not_applicable": not_applicable(family, ModeName.TEMPLATE_EDIT, "cached-activation edits")})
    report = {"benchmark": "fidelity",
              "setup": {**vars(args), "config": str(args.config), "out": str(args.out), "batch": BATCH,
                        "torch": torch.__version__},
              "rule": {"ssim_at_least": RULE_SSIM, "accuracy_within_points": RULE_POINTS},
              "exact_prompt_accuracy": accuracy, "seconds": seconds,
              "wall_s": round(time.perf_counter() - started, 1), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_fidelity(rows, f"fidelity vs exact, {args.model}: {args.prompts} held-out prompts, {args.steps} steps, "
                        f"CFG {args.guidance}", args.out / "fidelity.png")
    for r in rows:
        if "not_applicable" in r:
            print(f"{r['approximation']}: not applicable: {r['not_applicable']}")
        else:
            psnr_db = "identical" if r["psnr_db"] is None else f"{r['psnr_db']:.1f} dB"
            share = "".join(f", {key} {r[key]:.3f}" for key in ("reused", "computed_tokens") if key in r)
            print(f"{r['approximation']}, {r['setting']}{' [default]' if r['default'] else ''}: PSNR {psnr_db}, "
                  f"SSIM {r['ssim']:.4f}, accuracy {r['prompt_accuracy']:.3f} vs {r['exact_prompt_accuracy']:.3f}"
                  f"{share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
