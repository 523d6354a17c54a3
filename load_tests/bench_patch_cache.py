"""Patch-level cache reuse across denoising steps (PatchedServe §5, §7; `engine.patch_cache`):
an SD3 generation with each block's output of each patch reused from the request's previous step
where a learned predictor allows, against the exact generation (same request, same seed).

1. Calibration: exact generations of a few fixed requests (prompts and seeds below) record, per
   block, patch and step, how far the block's input and output moved against each of the last
   three steps. For each tolerance, a logistic regression is fitted to them: reuse a patch when
   its cached output is predicted to differ from the exact one by less than the tolerance
   (relative MSE). Calibrated at `--calibrate-size`, evaluated at `--size`: the features are
   relative, so one predictor serves every resolution.
2. The evaluation request runs exact once, recording the same statistics: the held-out samples
   the predictors are scored on (accuracy, against always answering the commoner label), and
   the reference latents and image.
3. Each tolerance's generation with the patch cache: PSNR and SSIM of the decoded image and the
   relative L2 error of the latents against the exact ones; the share of patch decisions that
   reused (PatchedServe Fig. 19's computation savings), overall and per step.
4. Speed: whole generations, stepped in lockstep with each step's forwards timed round-robin
   (`stepserve.profiling.common.interleaved_times`), `--repeats` times: the exact
   forward (`family.denoise`), the patch cache with a predictor that never reuses (the cost of
   the cache's bookkeeping alone), and each tolerance.

Random weights, built from the preset's configs with a fixed seed; nothing is downloaded. With
random weights the blocks barely change their input, so a patch's change between steps is mostly
the step's own and patches of one step are decided alike: this measures the mechanism (fidelity
against reuse, what reuse saves), not what a trained model's patches would allow.

    python -m stepserve.load_tests.bench_patch_cache --threads 1 --out docs/results/patch-cache

Writes patch_cache.json and patch_cache.png into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse
from stepserve.engine.patch_cache.calibration import record_generations
from stepserve.engine.patch_cache.predictor import ReusePredictor, fit_predictor, score
from stepserve.engine.sampler import Sampler
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.load_tests.fidelity import psnr, ssim
from stepserve.policies.types import RequestSpec
from stepserve.profiling.common import Stopwatch, device_description, interleaved_times, log, set_threads

MODEL = "sd3-bench"
CALIBRATION = (("a red fox in the snow", 11), ("a city street at night", 12))  # (prompt, seed)
EVALUATION = ("a bowl of fruit on a wooden table", 21)
GUIDANCE = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_patch_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="small", help="an SD3 preset (engine.families.sd3.PRESETS)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=512, help="the evaluated request's side in pixels")
    parser.add_argument("--calibrate-size", type=int, default=256, help="the calibration requests' side in pixels")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--side", type=int, default=4, help="a cache patch's side in image tokens (16 px each)")
    parser.add_argument("--tolerances", type=float, nargs="+", default=[3e-3, 1e-2],
                        help="output changes (relative MSE) a reused patch may make, one predictor each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own); 1 is steadier on a shared machine")
    return parser.parse_args(argv)


def _spec(rid: str, prompt: str, seed: int, size: int, steps: int) -> RequestSpec:
    return RequestSpec(request_id=rid, model=MODEL, prompt=prompt, width=size, height=size, num_inference_steps=steps,
                       guidance_scale=GUIDANCE, seed=seed, negative_prompt="", cfg=True)


class Generation:
    """One request generated from scratch, exact (`reuse` None: `family.denoise`) or with the
    patch cache, a step at a time; keeps, per step, the share of patch decisions that reused."""

    def __init__(self, family: Any, spec: RequestSpec, reuse: PatchReuse | None):
        self.family, self.spec, self.reuse = family, spec, reuse
        self.text = encode_conditioning(family, spec)
        self.blocks = len(family.denoiser.transformer_blocks)

    def start(self) -> None:
        self.sampler = Sampler(self.spec, self.family, self.text)
        self.cache = PatchCache(self.sampler.rows)
        self.step_shares: list[float] = []

    @torch.inference_mode()
    def step(self) -> None:
        sample, timesteps, cond = self.sampler.model_input()
        if self.reuse is None:
            self.sampler.advance(self.family.denoise(sample, timesteps, cond))
            return
        before = int(self.cache.reused.sum()) if self.cache.reused is not None else 0
        self.sampler.advance(self.family.denoise_patch_cached(sample, timesteps, cond, [self.cache], self.reuse))
        decisions = self.cache.decided / self.cache.steps * self.blocks
        self.step_shares.append((int(self.cache.reused.sum()) - before) / decisions)


def timed_generations(cases: dict[Any, Generation], steps: int, watch: Stopwatch,
                      repeats: int) -> dict[Any, list[float]]:
    """Each case's generation time, `repeats` times: the cases step in lockstep, their forwards
    of each step timed round-robin (`interleaved_times`), so drift on a shared machine hits every
    case alike within seconds rather than whichever generation ran while it lasted."""
    totals: dict[Any, list[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for generation in cases.values():
            generation.start()
        spent = dict.fromkeys(cases, 0.0)
        for _ in range(steps):
            for key, times in interleaved_times({key: g.step for key, g in cases.items()}, watch, 0, 1).items():
                spent[key] += times[0]
        for key, seconds in spent.items():
            totals[key].append(seconds)
    return totals


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = set_threads(args.threads)
    started = time.perf_counter()
    source = ModelSource(name=MODEL, family="sd3", preset=args.preset, seed=args.seed)
    family = load_family(source, ALL_PARTS, args.device)
    blocks = len(family.denoiser.transformer_blocks)
    log(f"sd3 {args.preset} on {device_description(args.device)}: {blocks} blocks, {threads} threads")

    calibration = [Sampler(spec, family, encode_conditioning(family, spec)) for spec in
                   (_spec(f"cal{i}", prompt, seed, args.calibrate_size, args.steps)
                    for i, (prompt, seed) in enumerate(CALIBRATION))]
    train = record_generations(family, calibration, args.side).samples()
    spec = _spec("eval", *EVALUATION, args.size, args.steps)
    evaluated = Sampler(spec, family, encode_conditioning(family, spec))
    held_out = record_generations(family, [evaluated], args.side).samples()
    log(f"recorded {len(train)} calibration samples at {args.calibrate_size} px, {len(held_out)} held-out at "
        f"{args.size} px, in {time.perf_counter() - started:.0f} s")

    predictors = {tol: fit_predictor(train, tol, blocks) for tol in args.tolerances}
    never = ReusePredictor(0.0, 0.0, (-math.inf,) * blocks, min(args.tolerances))
    cases = {"exact": Generation(family, spec, None), "never": Generation(family, spec, PatchReuse(never, args.side))}
    cases.update({tol: Generation(family, spec, PatchReuse(p, args.side)) for tol, p in predictors.items()})
    times = timed_generations(cases, args.steps, Stopwatch(args.device), args.repeats)
    exact_s = statistics.median(times["exact"])

    reference = family.decode(evaluated.latents)[0]
    results = []
    for tol, predictor in predictors.items():
        generation = cases[tol]
        image = family.decode(generation.sampler.latents)[0]
        seconds = statistics.median(times[tol])
        results.append({
            "tolerance": tol, "predictor": asdict(predictor),
            "train_score": asdict(score(predictor, train)), "held_out_score": asdict(score(predictor, held_out)),
            "reuse_share": generation.cache.reuse_share(), "reuse_share_per_step": generation.step_shares,
            "psnr_db": _db(psnr(image, reference)), "ssim": ssim(image, reference),
            "latents_rel_l2": _rel_l2(generation.sampler.latents, evaluated.latents),
            "generation_s": seconds, "generation_samples_s": times[tol], "speedup": exact_s / seconds,
        })
        log(f"tolerance {tol:g}: held-out accuracy {results[-1]['held_out_score']['accuracy']:.3f} (majority "
            f"{results[-1]['held_out_score']['majority']:.3f}), reused {results[-1]['reuse_share']:.1%}, "
            f"PSNR {psnr(image, reference):.1f} dB, SSIM {results[-1]['ssim']:.4f}, {exact_s / seconds:.2f}x")
    return {
        "benchmark": "patch_cache",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_description(args.device), "threads": threads,
        "preset": args.preset, "blocks": blocks, "size": args.size, "calibrate_size": args.calibrate_size,
        "steps": args.steps, "patch_side_tokens": args.side, "rows": evaluated.rows, "repeats": args.repeats,
        "calibration": [{"prompt": p, "seed": s} for p, s in CALIBRATION],
        "evaluation": {"prompt": EVALUATION[0], "seed": EVALUATION[1]},
        "train_samples": len(train), "held_out_samples": len(held_out),
        "exact_generation_s": exact_s, "exact_samples_s": times["exact"],
        "never_reuse_generation_s": statistics.median(times["never"]), "never_reuse_samples_s": times["never"],
        # The exact generation through `family.denoise` equals the recorded one (the reference).
        "exact_matches_reference": bool(torch.equal(cases["exact"].sampler.latents, evaluated.latents)),
        "never_reuse_matches_reference": bool(torch.equal(cases["never"].sampler.latents, evaluated.latents)),
        "results": results,
        "wall_s": time.perf_counter() - started,
    }


def _db(value: float) -> float | None:
    """PSNR for JSON: None where the images are equal (infinite)."""
    return None if math.isinf(value) else value


def _rel_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.float() - reference.float()).norm() / reference.float().norm())


def plot(result: dict[str, Any], path: Path) -> None:
    """Generation time per case, fidelity per tolerance, and the share of patches reused per step."""
    figure = Figure(figsize=(13, 4), layout="constrained")
    FigureCanvasAgg(figure)
    rows = result["results"]
    times, speed, share = figure.subplots(1, 3)
    labels = ["exact", "cache,\nnever reuse"] + [f"tol {r['tolerance']:g}" for r in rows]
    seconds = [result["exact_generation_s"], result["never_reuse_generation_s"]] + [r["generation_s"] for r in rows]
    bars = times.bar(labels, seconds, color=["tab:gray", "tab:olive"] + ["tab:blue"] * len(rows))
    times.bar_label(bars, [f"{result['exact_generation_s'] / s:.2f}x" for s in seconds])
    times.set_ylabel(f"generation time (s), {result['steps']} steps")
    times.set_title(f"SD3 {result['preset']}, {result['size']} px, {result['rows']} rows")
    x = np.arange(len(rows))
    speed.bar(x, [r["psnr_db"] if r["psnr_db"] is not None else 0 for r in rows], 0.5, color="tab:green")
    for i, r in enumerate(rows):
        speed.annotate(f"SSIM {r['ssim']:.4f}\nreused {r['reuse_share']:.0%}\n"
                       f"acc {r['held_out_score']['accuracy']:.3f}", (i, 1), ha="center", va="bottom", fontsize=8)
    speed.set_xticks(x, [f"tol {r['tolerance']:g}" for r in rows])
    speed.set_ylabel("PSNR vs exact (dB)")
    speed.set_title("fidelity of the decoded image")
    for r in rows:
        steps = np.arange(1, len(r["reuse_share_per_step"]) + 1)
        share.plot(steps, r["reuse_share_per_step"], marker="o", label=f"tol {r['tolerance']:g}")
    share.set_xlabel("step")
    share.set_ylabel("patch decisions reused")
    share.set_ylim(-0.05, 1.05)
    share.legend()
    share.set_title(f"patches of {result['patch_side_tokens']}x{result['patch_side_tokens']} tokens")
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "patch_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "patch_cache.png")
    log(f"wrote {args.out / 'patch_cache.json'} and patch_cache.png in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
