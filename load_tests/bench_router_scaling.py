"""What the router costs as the pool grows: N simulated requests on W workers, at the same
offered load per worker, timed on this machine.

    python -m stepserve.load_tests.bench_router_scaling --out results/router-scaling

The bar (issue): the router's per-round cost must grow with what changed, not with workers ×
wake-ups. The simulator drives the live `RouterCore` and policy and charges their decisions no
simulated time, so its wall clock per simulated request is the router's cost plus the
simulator's own bookkeeping, and `decision_wall_s` is the router's part alone. If both stay
flat as W grows, a round costs what changed; if they grow with W, something walks the pool.

Defaults: `synerdiff-mixed` (SD1.5, 512-1024 px, 20-50 steps) on the `sd15-a100` profile (GPU
magnitudes: steps of tens to hundreds of ms), continuous batching, batch cap 8, one decoder
per worker, 20,000 requests for every W in 8, 64, 512. The offered rate is
`--rate-per-worker` × W; 0.3 req/s per worker keeps the pool about 80% busy (measured at 64
workers on this profile: 0.25 → 67%, 0.30 → 80%, 0.35 → 92% busy over the run), so every W
sees the same load per worker. The queue bound is the request count: the run measures
scheduling, not admission.

Writes <out>/router_scaling.json after each point (a long run keeps what it finished) and
<out>/router_scaling.png (wall and decision seconds per simulated request against W). With
--cprofile every point runs under cProfile: <out>/profile-W<W>.pstats, and the top functions
by cumulative time on stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.metrics import percentile
from stepserve.load_tests.plots import plot_router_scaling
from stepserve.load_tests.sim import SimConfig, SimResult, simulate
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_router_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for router_scaling.json and .png")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512],
                        help="pool sizes, run in this order (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=20_000, help="requests per pool size (default: %(default)s)")
    parser.add_argument("--rate-per-worker", type=float, default=0.3,
                        help="offered req/s per worker (default: %(default)s, about 80%% busy)")
    parser.add_argument("--workload", default="synerdiff-mixed", help="workload name or YAML (default: %(default)s)")
    parser.add_argument("--profile", default="sd15-a100", help="cost profile name or CSV (default: %(default)s)")
    parser.add_argument("--policy", default="continuous", help="policy by registry name (default: %(default)s)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="requests per worker (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="override the workload's seed")
    parser.add_argument("--cprofile", action="store_true", help="run every point under cProfile and keep its stats")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rate_per_worker <= 0 or any(w < 1 for w in args.workers):
        parser.error("--requests, --rate-per-worker and --workers must be positive")
    return args


def run_point(args: argparse.Namespace, cost: Any, workers: int) -> dict[str, Any]:
    spec = replace(load_workload(args.workload), num_requests=args.requests, duration_s=None)
    if args.seed is not None:
        spec = replace(spec, seed=args.seed)
    rate = args.rate_per_worker * workers
    requests = generate(spec.with_rate(rate), cost)
    config = SimConfig(workers=workers, max_batch_size=args.max_batch_size, policy=args.policy, decoders=workers,
                       max_queued_images=args.requests, max_queued_videos=args.requests)
    profiler = cProfile.Profile() if args.cprofile else None
    cpu = time.process_time()
    if profiler is not None:
        profiler.enable()
    result = simulate(requests, cost, config)
    if profiler is not None:
        profiler.disable()
    cpu = time.process_time() - cpu
    if profiler is not None:
        stats_path = args.out / f"profile-W{workers}.pstats"
        profiler.dump_stats(stats_path)
        print(f"\n-- cProfile, {workers} workers (cumulative; full stats in {stats_path}) --")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(30)
    return point(result, workers, rate, cpu)


def point(result: SimResult, workers: int, rate: float, cpu_s: float) -> dict[str, Any]:
    n = len(result.traces)
    decision_ms = [1e3 * s for s in result.decision_wall_s]
    decision_s = sum(result.decision_wall_s)
    summary = result.summary(rate)
    return {
        "workers": workers, "requests": n, "offered_rps": rate, "finished": summary.ok,
        "busy_fraction": summary.busy_fraction, "slo_attainment": summary.slo_attainment,
        "latency_p95_s": summary.latency_p95_s, "simulated_s": result.end_s,
        "wall_s": result.wall_s, "cpu_s": cpu_s, "decision_s": decision_s,
        "wall_s_per_request": result.wall_s / n, "decision_s_per_request": decision_s / n,
        "decision_share": decision_s / result.wall_s if result.wall_s else None,
        "decisions": result.decisions, "decisions_per_request": result.decisions / n,
        "decision_ms_mean": statistics.fmean(decision_ms) if decision_ms else None,
        "decision_ms_p50": percentile(decision_ms, 50), "decision_ms_p99": percentile(decision_ms, 99),
        "rounds": result.rounds, "events": result.events,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cost = load_profile(args.profile)
    report: dict[str, Any] = {
        "benchmark": "router_scaling", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "workload": args.workload, "profile": args.profile, "policy": args.policy,
        "requests": args.requests, "rate_per_worker": args.rate_per_worker, "max_batch_size": args.max_batch_size,
        "points": [],
    }
    json_path, png_path = args.out / "router_scaling.json", args.out / "router_scaling.png"
    print(f"{'workers':>8}{'req/s':>9}{'busy':>6}{'wall s':>9}{'decide s':>10}{'ms/req':>8}{'dec ms/req':>11}"
          f"{'dec/req':>8}{'dec p99 ms':>11}")
    for workers in args.workers:
        p = run_point(args, cost, workers)
        report["points"].append(p)
        json_path.write_text(json.dumps(report, indent=1))
        print(f"{workers:>8}{p['offered_rps']:>9.1f}{p['busy_fraction']:>6.2f}{p['wall_s']:>9.1f}"
              f"{p['decision_s']:>10.1f}{1e3 * p['wall_s_per_request']:>8.2f}"
              f"{1e3 * p['decision_s_per_request']:>11.2f}{p['decisions_per_request']:>8.1f}"
              f"{p['decision_ms_p99']:>11.2f}", flush=True)
    plot_router_scaling(report["points"], f"{args.workload} on {args.profile}, {args.policy}, "
                        f"{args.rate_per_worker:g} req/s per worker", png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
