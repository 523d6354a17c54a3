"""The elastic denoiser pool through a load step, simulated at GPU magnitude: SLO attainment and
what the pool costs (worker-seconds) with scaling (`workers.autoscaling`) against fixed pools of
its minimum and of its maximum size.

The load steps up and back down: a quiet phase the minimum pool serves, a busy one only the
maximum pool serves, and a quiet one again (Poisson arrivals in each). The mix is PatchedServe
§8's on SDXL's shipped GPU-magnitude profile (`sdxl-h800`, DERIVED from published figures, not
measured: configs/profiles/README.md): 512, 768 and 1024 px in equal shares, 50 steps with CFG,
SLO = 5 x each request's solo latency. The elastic pool runs the live router's scaler
(`routing.pool_scaler`, once a simulated second) and a worker it starts serves `--start-s` later
(a GPU node coming up and the worker loading its model: about a minute on a cloud cluster, far
less with warm nodes). Every row gets the same requests.

    python -m stepserve.load_tests.bench_elastic_pool --out docs/results/elastic-pool

Writes elastic_pool.json and elastic_pool.png (pool size and SLO attainment over time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.metrics import summarize
from stepserve.load_tests.plots import plot_elastic_pool
from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.sweep import format_summary
from stepserve.load_tests.workload import (PoissonArrivals, RequestClass, ScheduledRequest, SizeChoice, StepsChoice,
                                           WorkloadSpec, generate)
from stepserve.policies.cost_model import CostModel, load_profile
from stepserve.routing.pool_scaler import ScalingSpec

PROFILE, MODEL = "sdxl-h800", "stable-diffusion-xl-base-1.0"
SIZES = (512, 768, 1024)
STEPS = 50
SLO_SCALE = 5.0
WINDOW_S = 30.0  # attainment over time: by the arrival's window


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_elastic_pool", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG files")
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--phases", default="300:0.5,600:2.5,300:0.5",
                        help="seconds:req/s of each phase, in order (default: %(default)s)")
    parser.add_argument("--start-s", type=float, default=60.0, help="a started worker serves this much later")
    parser.add_argument("--scale-down-delay-s", type=float, default=30.0)
    parser.add_argument("--target-requests", type=float, default=4.0)
    parser.add_argument("--max-batch-size", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.phases = [(float(d), float(r)) for d, r in (p.split(":") for p in args.phases.split(","))]
    except ValueError:
        parser.error(f"--phases: expected seconds:rate,... got {args.phases!r}")
    return args


def requests_of(phases: list[tuple[float, float]], cost: CostModel, seed: int) -> list[ScheduledRequest]:
    """Poisson arrivals at each phase's rate, one phase after the other."""
    mix = RequestClass("mixed", MODEL, tuple(SizeChoice(s, s) for s in SIZES), StepsChoice(choices=(STEPS,)),
                       guidance_scale=7.5, unique_prompts=True)
    out: list[ScheduledRequest] = []
    start = 0.0
    for i, (duration, rate) in enumerate(phases):
        phase = WorkloadSpec(PoissonArrivals(rate), (mix,), duration_s=duration, slo_scale=SLO_SCALE, seed=seed + i)
        phase_requests = generate(phase, cost)
        out += [replace(r, index=len(out) + j, offset_s=start + r.offset_s) for j, r in enumerate(phase_requests)]
        start += duration
    return out


def config(args: argparse.Namespace, workers: int, scaling: ScalingSpec | None) -> SimConfig:
    # A GPU cluster: a VAE decoder per worker of the largest pool, a text encoder per four;
    # queues that never reject, so every request counts in the attainment.
    return SimConfig(workers=workers, max_batch_size=args.max_batch_size, decoders=args.max_workers,
                     text_encoder=TextEncoderSpec(replicas=max(1, args.max_workers // 4)),
                     max_queued_images=1_000_000, scaling=scaling, worker_start_s=args.start_s)


def windows(result, end_s: float) -> list[dict[str, Any]]:
    out = []
    start = 0.0
    while start < end_s:
        traces = [t for t in result.traces if start <= t.arrival_s < start + WINDOW_S]
        out.append({"start_s": start, "requests": len(traces),
                    "slo_attainment": sum(t.met_slo for t in traces) / len(traces) if traces else None})
        start += WINDOW_S
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cost = load_profile(PROFILE)
    requests = requests_of(args.phases, cost, args.seed)
    end_s = sum(d for d, _ in args.phases)
    scaling = ScalingSpec(args.min_workers, args.max_workers, args.target_requests, args.scale_down_delay_s)
    rows = (
        (f"fixed {args.min_workers}", config(args, args.min_workers, None)),
        (f"elastic {args.min_workers}-{args.max_workers}", config(args, args.min_workers, scaling)),
        (f"fixed {args.max_workers}", config(args, args.max_workers, None)),
    )
    runs = []
    for label, sim_config in rows:
        result = simulate(requests, cost, sim_config)
        summary = summarize(result.records(), result.busy_s)
        print(f"[{label}] {format_summary(summary)}; {result.worker_s:.0f} worker-s ({result.wall_s:.1f} s wall)",
              file=sys.stderr, flush=True)
        runs.append({"label": label, "summary": asdict(summary), "worker_s": result.worker_s,
                     "pool": [list(p) for p in result.pool], "windows": windows(result, end_s),
                     "unfinished": sum(t.status != "finished" for t in result.traces), "wall_s": result.wall_s})
    report = {
        "benchmark": "elastic_pool", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "profile": PROFILE,
        "profile_kind": "derived from published figures, not measured", "model": MODEL, "sizes": SIZES,
        "steps": STEPS, "slo_scale": SLO_SCALE, "phases": [{"duration_s": d, "rate": r} for d, r in args.phases],
        "requests": len(requests), "scaling": asdict(scaling), "worker_start_s": args.start_s,
        "max_batch_size": args.max_batch_size, "seed": args.seed, "window_s": WINDOW_S, "runs": runs,
    }
    report["wall_s"] = time.perf_counter() - started
    (args.out / "elastic_pool.json").write_text(json.dumps(report, indent=1))
    plot_elastic_pool(report, args.out / "elastic_pool.png")
    for run in runs:
        s = run["summary"]
        print(f"{run['label']:<16} SLO {100 * (s['slo_attainment'] or 0):5.1f}%  p95 {s['latency_p95_s'] or 0:7.1f} s  "
              f"{run['worker_s']:8.0f} worker-s  unfinished {run['unfinished']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
