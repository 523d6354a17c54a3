"""Step caching per request (`RequestSpec.step_cache`, the First-Block Cache of
`engine.step_cache`, with each `step_cache_method`: reuse as it was, or TaylorSeer's first-order
extrapolation) on the shapes model: for each method and threshold, the speed-up of a request and its
pictures' fidelity to the exact ones (PSNR, SSIM, prompt accuracy), with every request of the
batch caching and with half of them caching beside exact partners (who must stay exact); with
`--skip-cfg-from`, also with every request caching and skipping CFG (SynerDiff's skip-CFG, which
the step cache's forward composes with).

Pictures are made as the server makes them (bench_shapes' `draw`: `StepRunner`, one batched forward
per step, the worker's decode), `--batch` requests at a time. A request's latency is the sum of its
batch's step times, so its speed-up is the ratio of the batch's times (exact over cached), measured
interleaved (`--repeats` rounds, each variant once per round, medians): end to end (prompt
encoding and decode included) and of the denoising steps alone. Also the share of a forward the
UNet's head takes (what every row runs before it may skip), which the cost model prices with.

    python -m stepserve.load_tests.bench_step_cache --out docs/results/step-cache

Writes step_cache.json and step_cache.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.shapes import dataset
from stepserve.engine.shapes.judge import prompt_accuracy
from stepserve.load_tests.bench_fidelity import compare
from stepserve.load_tests.bench_shapes import HELD_OUT_SEED, add_drawing_arguments, draw, load_served, specs_for
from stepserve.policies.types import StepCacheMethod

RULE_SSIM, RULE_SPEEDUP = 0.95, 1.5  # the bar: >= 1.5x a request at SSIM >= 0.95
SKIPPING = "all, skipping CFG"  # the batch label of every request caching and skipping CFG (--skip-cfg-from)


class Counted:
    """A plain worker's step runner that keeps every step cache it gave a request (they leave
    with their requests), to count the steps that computed and skipped, and times its plans that
    only step (neither admitting nor finishing: the denoising alone)."""

    def __init__(self, family, model: str):
        from stepserve.engine.step_runner import StepRunner

        self.runner = StepRunner("bench", {model: family}, decode_images=True)
        self.caches = []
        self.step_s = 0.0
        self.execute = self.runner.execute
        self.runner.execute = self._execute

    def _execute(self, plan, admissions, **kwargs):
        out = self.execute(plan, admissions, **kwargs)
        if plan.groups and not (plan.admit or plan.finish):
            self.step_s += out[0].duration_s
        self.caches += [s.mode_state for rid, s in self.runner.samplers.items()
                        if rid in plan.admit and s.mode is ModeName.STEP_CACHE]
        return out

    def skip_share(self) -> float:
        computed = sum(c.computed for c in self.caches)
        skipped = sum(c.skipped for c in self.caches)
        return skipped / (computed + skipped) if computed + skipped else 0.0


def head_share(family, rows: int, size: int, repeats: int = 5) -> float:
    """The share of a forward of `rows` rows at `size` px the UNet's head takes (what every row
    runs before it may skip): medians of interleaved timings."""
    import torch

    from stepserve.engine.step_cache.split_unet import split_unet

    unet, side = family.denoiser, size // family.vae_scale_factor
    generator = torch.Generator("cpu").manual_seed(0)
    sample = torch.randn(rows, unet.config.in_channels, side, side, generator=generator)
    context = torch.randn(rows, 77, unet.config.cross_attention_dim, generator=generator)
    timesteps = torch.full((rows,), 500.0)
    heads, wholes = [], []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            split = split_unet(unet, sample, timesteps, context)
            start = time.perf_counter()
            _, carry = split.head()
            middle = time.perf_counter()
            split.body(carry)
            heads.append(middle - start)
            wholes.append(time.perf_counter() - start)
    return statistics.median(heads[1:]) / statistics.median(wholes[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_step_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drawing_arguments(parser, prompts=50)
    parser.add_argument("--thresholds", default="0.05,0.1,0.15,0.2,0.3",
                        help="step_cache thresholds to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--methods", default="first_block,taylorseer",
                        help="step_cache_method values to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--skip-cfg-from", type=float, default=None,
                        help="also measure every request caching and skipping CFG from this fraction of its steps "
                             "(SynerDiff's skip-CFG composed with the step cache; e.g. 0.4, what S = 0.95 picks on "
                             "the shapes model); default: not measured")
    parser.add_argument("--batch", type=int, default=25, help="requests denoised together (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("results/step-cache"))
    args = parser.parse_args(argv)

    import torch

    from stepserve.load_tests.plots import plot_step_cache
    from stepserve.oneshot import quiet_libraries
    from stepserve.profiling.common import log

    torch.set_num_threads(args.threads)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    methods = [StepCacheMethod(m) for m in args.methods.split(",")]
    started = time.perf_counter()
    with quiet_libraries():
        _, _, family, judge = load_served(args)
        scenes = dataset.Renders(HELD_OUT_SEED, args.prompts).scenes
        plain = specs_for([s.caption for s in scenes], args, "r")

        def variant(method: StepCacheMethod, threshold: float, every: int, skip_cfg_from: float = 1.0) -> list:
            """`plain` with every `every`-th request (from the first) caching at `threshold` (and
            skipping CFG from `skip_cfg_from` of its steps)."""
            return [dataclasses.replace(s, step_cache=threshold, step_cache_method=method, skip_cfg_from=skip_cfg_from)
                    if i % every == 0 else s for i, s in enumerate(plain)]

        exact_key = (None, "exact", 0.0)
        variants = {exact_key: plain}
        for method in methods:
            for t in thresholds:
                variants[(method, "all", t)] = variant(method, t, 1)
                variants[(method, "half", t)] = variant(method, t, 2)
                if args.skip_cfg_from is not None:
                    variants[(method, SKIPPING, t)] = variant(method, t, 1, args.skip_cfg_from)
        times: dict = {key: [] for key in variants}
        step_times: dict = {key: [] for key in variants}
        pictures, skips = {}, {}
        for rnd in range(args.repeats):
            for key, specs in variants.items():
                counted = Counted(family, args.model)
                start = time.perf_counter()
                drawn = np.concatenate([draw(family, specs[i:i + args.batch], runner=counted.runner)
                                        for i in range(0, len(specs), args.batch)])
                times[key].append(time.perf_counter() - start)
                step_times[key].append(counted.step_s)
                pictures[key], skips[key] = drawn, counted.skip_share()
            log(f"round {rnd + 1}/{args.repeats}: " + ", ".join(
                f"{k[0].value if k[0] else ''} {k[1]} {k[2]:g} {v[-1]:.2f} s" for k, v in times.items()))
        exact, exact_s = pictures[exact_key], statistics.median(times[exact_key])
        exact_step_s = statistics.median(step_times[exact_key])
        head = head_share(family, 2 * args.batch, args.size)
        accuracy = prompt_accuracy(judge, exact, scenes)
        rows = []
        for key, specs in variants.items():
            method, batch, t = key
            if method is None:
                continue
            caching = np.array([s.step_cache > 0 for s in specs])
            seconds = statistics.median(times[key])
            step_s = statistics.median(step_times[key])
            row = {"method": method.value, "threshold": t, "batch": batch, "caching_share": float(caching.mean()),
                   "skip_cfg_from": args.skip_cfg_from if batch == SKIPPING else 1.0,
                   "seconds": seconds,
                   "speedup": exact_s / seconds, "denoise_speedup": exact_step_s / step_s,
                   "skipped_step_share": skips[key],
                   **compare(pictures[key][caching], exact[caching], [s for s, c in zip(scenes, caching) if c],
                             judge, prompt_accuracy(judge, exact[caching], [s for s, c in zip(scenes, caching) if c]))}
            if not caching.all():  # its exact partners: the same pictures as alone
                others = pictures[key][~caching].astype(int) - exact[~caching].astype(int)
                row["partners_max_pixel_difference"] = int(np.abs(others).max())
            row["meets_rule"] = row["ssim"] >= RULE_SSIM and row["denoise_speedup"] >= RULE_SPEEDUP
            rows.append(row)
            log(f"{method.value} {batch} {t:g}: {row['speedup']:.2f}x, skipped {row['skipped_step_share']:.2f}, "
                f"SSIM {row['ssim']:.3f}, accuracy {row['prompt_accuracy']:.3f}")
    report = {"benchmark": "step_cache",
              "setup": {**vars(args), "config": str(args.config), "out": str(args.out), "torch": torch.__version__},
              "rule": {"ssim_at_least": RULE_SSIM, "speedup_at_least": RULE_SPEEDUP},
              "exact": {"seconds": exact_s, "denoise_seconds": exact_step_s, "prompt_accuracy": accuracy},
              "head_share": head, "rows": rows,
              "wall_s": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_cache.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_step_cache(report, f"step caching per request, {args.model}: {args.prompts} held-out prompts, "
                            f"{args.steps} steps, batches of {args.batch}", args.out / "step_cache.png")
    for r in rows:
        print(f"{r['method']}, {r['batch']} caching, threshold {r['threshold']:g}: {r['speedup']:.2f}x end to end, "
              f"{r['denoise_speedup']:.2f}x denoising, skipped "
              f"{r['skipped_step_share']:.0%} of steps, SSIM {r['ssim']:.3f}, accuracy {r['prompt_accuracy']:.3f} "
              f"(exact {r['exact_prompt_accuracy']:.3f})"
              + (f", partners' max pixel difference {r['partners_max_pixel_difference']}"
                 if "partners_max_pixel_difference" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
