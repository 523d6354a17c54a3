"""What stepserve costs over plain diffusers for one request alone, same model, same work.

Engine level (always): text encode + a `StepRunner` executing one plan per step + VAE decode,
against `StableDiffusionPipeline.__call__` over the very same modules, same prompt, seed,
size and steps, with torch's thread count fixed. The two are run interleaved (alternating
which goes first) so drift on a shared machine hits both alike, and the outputs are checked
to be the same image (within a tolerance of the device and dtype: reported, and flagged when
exceeded), so the comparison cannot quietly compare different work.

The engine level runs on `--device` (CPU by default; `cuda` measures the model from `--config`
on the GPU, e.g. the `full` preset in float16, synchronizing around every timing).

Live level (`--live`, or `--url` for a server already running on this machine): one HTTP
request at a time to the app versus the pipeline in this process. That ratio includes the
HTTP, Serve and Ray hops, a router round trip per step and PNG encoding, so it is reported,
not held to the engine target. It is CPU-local: refused with a CUDA `--device`.

    python -m stepserve.load_tests.bench_engine_overhead --out results/overhead
    python -m stepserve.load_tests.bench_engine_overhead --out results/overhead-gpu --device cuda \
        --config gpu.yaml --sizes 512 768
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepserve.deployments.config import AppConfig
from stepserve.engine.families import ALL_PARTS, DiffusionFamily, ModelSource, load_family
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.load_tests.plots import plot_overhead
from stepserve.load_tests.workload import DEFAULT_PROMPT, ScheduledRequest
from stepserve.policies.types import RequestSpec, StepGroup, WorkerPlan
from stepserve.profiling.common import Stopwatch
from stepserve.runtime import tiny_config_path, load_serve_config

TARGET_ENGINE_RATIO = 1.10  # the bar: stepserve / diffusers at engine level


def device_arg(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N`, as argparse type."""
    kind, _, index = text.partition(":")
    if (kind == "cpu" and not index) or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def same_image_tolerance(device: str, dtype: str) -> float:
    """Largest |served - pipeline| pixel difference (images in [0, 1]) still read as the same
    image: float32 on the CPU runs the very same kernels in the same order; the GPU picks its own
    (TF32 convolutions), and half precision rounds every step."""
    if dtype != "float32":
        return 5e-2
    return 1e-3 if device == "cpu" else 1e-2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m stepserve.load_tests.bench_engine_overhead", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for overhead.json and overhead.png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(),
                        help="Serve config whose first model is measured (and deployed with --live) "
                             "(default: %(default)s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256],
                        help="square image sizes, px (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="num_inference_steps (default: %(default)s)")
    parser.add_argument("--guidance", type=float, default=7.5, help="guidance_scale (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per side and case (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads here; 1 matches local-tiny.yaml's workers (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed of every request (default: %(default)s)")
    parser.add_argument("--device", type=device_arg, default="cpu",
                        help="where the engine level runs: cpu, cuda or cuda:N (default: %(default)s)")
    live = parser.add_mutually_exclusive_group()
    live.add_argument("--live", action="store_true",
                      help="also deploy the config on a lean local Ray and time HTTP requests against it")
    live.add_argument("--url", help="also time HTTP requests against this already running local server")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(),
                        help="CPUs the local Ray may schedule with --live (default: %(default)s)")
    args = parser.parse_args(argv)
    if (args.live or args.url) and args.device != "cpu":
        parser.error("--live and --url time the app on this machine's CPUs against the in-process pipeline; "
                     "run them with --device cpu")
    return args


def make_spec(source: ModelSource, size: int, steps: int, guidance: float, seed: int) -> RequestSpec:
    return RequestSpec(request_id="solo", model=source.name, prompt=DEFAULT_PROMPT, width=size, height=size,
                       num_inference_steps=steps, guidance_scale=guidance, seed=seed)


def stepserve_engine(family: DiffusionFamily, spec: RequestSpec) -> np.ndarray:
    """One request through the serving engine: what the text encoder, a denoiser worker running
    one plan per step (as the router writes them: admit with the first, finish with the last),
    and the VAE decoder do for it, without the Ray hops between them."""
    rid, steps = spec.request_id, spec.num_inference_steps
    admissions = {rid: Admission(spec, conditioning=encode_conditioning(family, spec))}
    runner = StepRunner("bench", {spec.model: family})
    for step in range(steps):
        first, last = step == 0, step == steps - 1
        plan = WorkerPlan("bench", admit=(rid,) if first else (), groups=(StepGroup((rid,)),),
                          finish=(rid,) if last else (), plan_id=step + 1)
        report, payloads = runner.execute(plan, admissions if first else {})
        if report.failed:
            raise RuntimeError(f"engine run failed: {report.failed}")
    [latents] = payloads  # the last plan's one output: the finished image's latents
    return family.decode(torch.from_numpy(latents))[0]


def diffusers_pipeline(family: DiffusionFamily, spec: RequestSpec) -> np.ndarray:
    """The same request through `StableDiffusionPipeline.__call__` over the same modules."""
    with torch.inference_mode():
        return family.pipe(
            spec.prompt, negative_prompt=spec.negative_prompt or None, height=spec.height, width=spec.width,
            num_inference_steps=spec.num_inference_steps, guidance_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed), output_type="np",
        ).images[0]


def timed(run: Callable[[], Any], sync: Callable[[], None] = lambda: None) -> tuple[float, Any]:
    """Wall time of `run()` and its output; `sync` is called before and after (on CUDA,
    `Stopwatch.sync`, so queued kernels count)."""
    sync()
    start = time.perf_counter()
    out = run()
    sync()
    return time.perf_counter() - start, out


def compare(label: str, ours: Callable[[], Any], theirs: Callable[[], Any],
            repeats: int, sync: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Warm both once, then `repeats` interleaved timings; even rounds run ours first.
    Returns the result row and each side's last output."""
    ours(), theirs()
    times: dict[str, list[float]] = {"stepserve": [], "diffusers": []}
    outputs: dict[str, Any] = {}
    for i in range(repeats):
        order = [("stepserve", ours), ("diffusers", theirs)]
        for name, run in order if i % 2 == 0 else order[::-1]:
            seconds, outputs[name] = timed(run, sync)
            times[name].append(seconds)
    row: dict[str, Any] = {"label": label, "stepserve_s": times["stepserve"], "diffusers_s": times["diffusers"],
                           "stepserve_median_s": statistics.median(times["stepserve"]),
                           "diffusers_median_s": statistics.median(times["diffusers"])}
    row["ratio"] = row["stepserve_median_s"] / row["diffusers_median_s"]
    return row, outputs


def engine_level(family: DiffusionFamily, source: ModelSource, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    sync, tolerance = Stopwatch(args.device).sync, same_image_tolerance(args.device, source.dtype)
    for size in args.sizes:
        spec = make_spec(source, size, args.steps, args.guidance, args.seed)
        row, out = compare(f"{size}px", lambda: stepserve_engine(family, spec),
                           lambda: diffusers_pipeline(family, spec), args.repeats, sync)
        # Same work or no comparison: the served image must be the pipeline's (fp tolerance).
        row["max_abs_diff"] = float(np.abs(out["stepserve"] - out["diffusers"]).max())
        row["same_image_tolerance"] = tolerance
        row["same_image"] = row["max_abs_diff"] <= tolerance  # False for NaN too
        rows.append({**row, "size": size, "steps": args.steps})
        print(f"engine {size}px: stepserve {row['stepserve_median_s']:.3f} s, diffusers {row['diffusers_median_s']:.3f}"
              f" s, ratio {row['ratio']:.3f}, max |diff| {row['max_abs_diff']:.1e}", file=sys.stderr)
        if not row["same_image"]:
            print(f"warning: {size}px images differ by {row['max_abs_diff']:.1e} > {tolerance:g}: the two sides may "
                  "not have done the same work", file=sys.stderr)
    return rows


def http_solo(url: str, spec: RequestSpec, timeout_s: float = 300.0) -> None:
    from stepserve.load_tests.live import run_open_loop

    request = ScheduledRequest(index=0, offset_s=0.0, num_inference_steps=spec.num_inference_steps, seed=spec.seed,
                               width=spec.width, height=spec.height, guidance_scale=spec.guidance_scale,
                               prompt=spec.prompt)
    [record] = asyncio.run(run_open_loop(url, [request], timeout_s, timeout_s))
    if not record.ok:
        raise RuntimeError(f"live request failed ({record.status}): {record.error}")


def live_level(url: str, family: DiffusionFamily, source: ModelSource,
               args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        spec = make_spec(source, size, args.steps, args.guidance, args.seed)
        row, _ = compare(f"{size}px", lambda: http_solo(url, spec), lambda: diffusers_pipeline(family, spec),
                         args.repeats)
        rows.append({**row, "size": size, "steps": args.steps})
        print(f"live {size}px: stepserve (HTTP) {row['stepserve_median_s']:.3f} s, diffusers (in-process) "
              f"{row['diffusers_median_s']:.3f} s, ratio {row['ratio']:.3f}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serve_config = load_serve_config(args.config)
    source = AppConfig.model_validate(serve_config["applications"][0].get("args", {})).models[0].to_source()
    torch.set_num_threads(args.threads)
    # CPU by default (the benchmark machine of this issue); on CUDA every timing synchronizes.
    family = load_family(source, ALL_PARTS, args.device)

    engine = engine_level(family, source, args)
    live = None
    if args.live or args.url:
        # Live only (Ray, Serve, httpx): the engine level runs without them.
        from stepserve.load_tests.live import check_loopback
        from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray

        with ExitStack() as stack:
            url = check_loopback(args.url) if args.url else None
            if url is None:
                stack.enter_context(local_ray(args.num_cpus))
                url = stack.enter_context(deployed(bench_serve_config(serve_config, free_port())))
            live = live_level(url, family, source, args)

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "engine_overhead",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "device": args.device,
                    "device_name": (torch.cuda.get_device_name(torch.device(args.device))
                                    if args.device.startswith("cuda") else platform.processor() or platform.machine())},
        "config_path": str(args.config),
        "model": {"name": source.name, "family": source.family, "preset": source.preset, "path": source.path,
                  "seed": source.seed, "dtype": source.dtype},
        "settings": {"steps": args.steps, "guidance_scale": args.guidance, "repeats": args.repeats,
                     "torch_threads": args.threads, "seed": args.seed, "prompt": DEFAULT_PROMPT},
        "target_engine_ratio": TARGET_ENGINE_RATIO,
        "engine": engine,
        "live": live,
        "live_target": args.url or ("local app from --config" if args.live else None),
    }
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1))
    panels = {"engine": engine, **({"live (HTTP vs in-process)": live} if live else {})}
    plot_overhead(panels, args.out / "overhead.png")

    print(f"\n{'level':<8}{'case':>8}{'stepserve s':>13}{'diffusers s':>13}{'ratio':>8}")
    for level, rows in panels.items():
        for row in rows:
            print(f"{level.split()[0]:<8}{row['label']:>8}{row['stepserve_median_s']:>13.3f}"
                  f"{row['diffusers_median_s']:>13.3f}{row['ratio']:>8.3f}")
    worst = max(row["ratio"] for row in engine)
    verdict = "meets" if worst <= TARGET_ENGINE_RATIO else "misses"
    print(f"engine-level stepserve / diffusers, worst case {worst:.3f} ({verdict} the {TARGET_ENGINE_RATIO} target)")
    print(f"wrote {args.out / 'overhead.json'} and {args.out / 'overhead.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
