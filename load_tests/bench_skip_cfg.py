"""SynerDiff's adaptive skip-CFG (`engine.forward_modes.skip_cfg`) on the shapes model: the
paper's Fig. 9 method. For each fraction f of the steps, every request runs its steps from f on
without its unconditional row; the pictures' similarity to the exact ones (PSNR, SSIM, prompt
accuracy) against f is the model's skip-CFG curve (what `skip_cfg_curve` in a model's config
holds, and from which a quality threshold S gives a request's `skip_cfg_from`), and the
batch's time against the exact batch's is a request's speed-up. Also with half the batch skipping
beside exact partners (who must stay exact).

Pictures are made as the server makes them (bench_shapes' `draw`: `StepRunner`, one batched
forward per step, the worker's decode), `--batch` requests at a time; timings are interleaved
(`--repeats` rounds, each variant once per round, medians).

    python -m stepserve.load_tests.bench_skip_cfg --out docs/results/skip-cfg

Writes skip_cfg.json (with `curve`: the (f, SSIM) points to paste into the model's config) and skip_cfg.png.
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

from stepserve.engine.shapes import dataset
from stepserve.engine.shapes.judge import prompt_accuracy
from stepserve.load_tests.bench_fidelity import compare
from stepserve.load_tests.bench_shapes import HELD_OUT_SEED, add_drawing_arguments, draw, load_served, specs_for

RULE_SSIM, RULE_SPEEDUP = 0.95, 1.5  # the bar: >= 1.5x a request at SSIM >= 0.95


class Timed:
    """A plain worker's step runner that times its plans that only step (the denoising alone)."""

    def __init__(self, family, model: str):
        from stepserve.engine.step_runner import StepRunner

        self.runner = StepRunner("bench", {model: family}, decode_images=True)
        self.step_s = 0.0
        self.execute = self.runner.execute
        self.runner.execute = self._execute

    def _execute(self, plan, admissions, **kwargs):
        out = self.execute(plan, admissions, **kwargs)
        if plan.groups and not (plan.admit or plan.finish):
            self.step_s += out[0].duration_s
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_skip_cfg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drawing_arguments(parser, prompts=50)
    parser.add_argument("--starts", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9",
                        help="fractions of the steps from which requests skip CFG (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=25, help="requests denoised together (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("results/skip-cfg"))
    args = parser.parse_args(argv)

    import torch

    from stepserve.load_tests.plots import plot_skip_cfg
    from stepserve.oneshot import quiet_libraries
    from stepserve.profiling.common import log

    torch.set_num_threads(args.threads)
    starts = [float(f) for f in args.starts.split(",")]
    started = time.perf_counter()
    with quiet_libraries():
        _, _, family, judge = load_served(args)
        scenes = dataset.Renders(HELD_OUT_SEED, args.prompts).scenes
        specs = specs_for([s.caption for s in scenes], args, "r")
        # (start, every): every `every`-th request skips CFG from fraction `start` of its steps
        variants = {(None, 1): specs, **{(f, every): [dataclasses.replace(s, skip_cfg_from=f) if i % every == 0
                                                      else s for i, s in enumerate(specs)]
                                         for f in starts for every in (1, 2)}}
        times: dict = {key: [] for key in variants}
        step_times: dict = {key: [] for key in variants}
        pictures = {}
        for rnd in range(args.repeats):
            for key, batch in variants.items():
                runner = Timed(family, args.model)
                begin = time.perf_counter()
                pictures[key] = np.concatenate([draw(family, batch[i:i + args.batch], runner=runner.runner)
                                                for i in range(0, len(batch), args.batch)])
                times[key].append(time.perf_counter() - begin)
                step_times[key].append(runner.step_s)
            log(f"round {rnd + 1}/{args.repeats}: " + ", ".join(
                f"{'exact' if k[0] is None else f'{k[0]:g}/{k[1]}'} {v[-1]:.2f} s" for k, v in times.items()))
        exact, exact_s = pictures[(None, 1)], statistics.median(times[(None, 1)])
        exact_step_s = statistics.median(step_times[(None, 1)])
        accuracy = prompt_accuracy(judge, exact, scenes)
        rows = []
        for (start, every), _ in variants.items():
            if start is None:
                continue
            skipping = np.arange(len(specs)) % every == 0
            key = (start, every)
            seconds, step_s = statistics.median(times[key]), statistics.median(step_times[key])
            skipping_scenes = [s for s, k in zip(scenes, skipping) if k]
            row = {"start": start, "batch": "all" if every == 1 else "half", "skipping_share": float(skipping.mean()),
                   "seconds": seconds, "speedup": exact_s / seconds, "denoise_speedup": exact_step_s / step_s,
                   **compare(pictures[key][skipping], exact[skipping], skipping_scenes, judge,
                             prompt_accuracy(judge, exact[skipping], skipping_scenes))}
            if not skipping.all():  # its exact partners: the same pictures as alone
                others = pictures[key][~skipping].astype(int) - exact[~skipping].astype(int)
                row["partners_max_pixel_difference"] = int(np.abs(others).max())
            row["meets_rule"] = row["ssim"] >= RULE_SSIM and row["denoise_speedup"] >= RULE_SPEEDUP
            rows.append(row)
            log(f"from {start:g}, {row['batch']}: {row['speedup']:.2f}x, SSIM {row['ssim']:.3f}, "
                f"accuracy {row['prompt_accuracy']:.3f}")
    curve = [[r["start"], round(r["ssim"], 4)] for r in rows if r["batch"] == "all"]
    report = {"benchmark": "skip_cfg",
              "setup": {**vars(args), "config": str(args.config), "out": str(args.out), "torch": torch.__version__},
              "rule": {"ssim_at_least": RULE_SSIM, "speedup_at_least": RULE_SPEEDUP},
              "exact": {"seconds": exact_s, "denoise_seconds": exact_step_s, "prompt_accuracy": accuracy},
              "curve": curve, "rows": rows, "wall_s": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "skip_cfg.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_skip_cfg(report, f"adaptive skip-CFG, {args.model}: {args.prompts} held-out prompts, {args.steps} steps, "
                          f"batches of {args.batch}", args.out / "skip_cfg.png")
    for r in rows:
        print(f"skip CFG from {r['start']:g} of the steps, {r['batch']} skipping: {r['speedup']:.2f}x end to end, "
              f"{r['denoise_speedup']:.2f}x denoising, SSIM {r['ssim']:.3f} (min {r['ssim_min']:.3f}), accuracy "
              f"{r['prompt_accuracy']:.3f} (exact {r['exact_prompt_accuracy']:.3f})"
              + (f", partners' max pixel difference {r['partners_max_pixel_difference']}"
                 if "partners_max_pixel_difference" in r else ""))
    print(f"curve (skip_cfg_curve): {json.dumps(curve)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
