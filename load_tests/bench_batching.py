"""Step-level continuous batching vs request-level static batching, live, at the same load.

For each policy the app from a Serve config (default: configs/local-tiny.yaml) is deployed with
only `router.policy` changed (same workers, same batch cap), warmed up, driven open-loop
with the same seeded Poisson workload of mixed step counts over HTTP, and deleted.

    python -m stepserve.load_tests.bench_batching --out results/batching
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stepserve.load_tests.live import run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray
from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.plots import plot_batching
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.server_metrics import histogram_totals, run_means, scrape_text, stage_means, stage_totals
from stepserve.load_tests.workload import PoissonWorkload, ScheduledRequest, generate
from stepserve.runtime import tiny_config_path, load_serve_config

POLICIES = ("continuous", "static_fcfs")
TARGET_P95_RATIO = 0.7  # the bar; InstGenIE reports 0.71x against static batching


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m stepserve.load_tests.bench_batching", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for batching.json and batching.png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(),
                        help="Serve config to deploy (default: %(default)s)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help="policies to compare, in run order")
    # Defaults, measured on a 2-core CPU box with local-tiny.yaml (load_tests/README.md): 64 px keeps
    # a batched step much cheaper per request than a solo one, as on a GPU; at 9 req/s continuous
    # batching is far from saturated while the static baseline's batches start blocking newcomers.
    parser.add_argument("--rate", type=float, default=9.0, help="offered load, requests/s (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=75.0,
                        help="seconds of arrivals per policy (default: %(default)s)")
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 20, 40],
                        help="num_inference_steps choices, drawn uniformly (default: %(default)s)")
    parser.add_argument("--size", type=int, default=64, help="image width and height, px (default: %(default)s)")
    parser.add_argument("--guidance", type=float, default=7.5, help="guidance_scale (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="requests sent (same mix) before each measured run (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=60.0,
                        help="seconds one request may take before it counts as failed (default: %(default)s)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(),
                        help="CPUs the local Ray may schedule (default: %(default)s)")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class PolicyRun:
    records: list[RequestRecord]
    server: dict[str, dict[str, float | None]]  # router histograms over the measured run
    # Per kind ("image", "video"), the mean seconds of each stage a finished request went through
    # (`stage_means`: router.text_encode, router.queue, router.denoise, ...); kinds never served are left out.
    stages: dict[str, dict[str, float | None]]


def run_policy(base_config: dict[str, Any], port: int, policy: str, warmup: list[ScheduledRequest],
               requests: list[ScheduledRequest], request_timeout_s: float) -> PolicyRun:
    config = bench_serve_config(base_config, port, policy)
    with deployed(config) as url:
        asyncio.run(wait_ready(url))
        if warmup:
            warm = asyncio.run(run_open_loop(url, warmup, request_timeout_s, warmup[-1].offset_s + request_timeout_s))
            failed = [r for r in warm if not r.ok]
            if failed:
                raise RuntimeError(f"{policy}: warm-up failed ({len(failed)} of {len(warm)}): {failed[0].error}")
        before = asyncio.run(scrape_text(url))
        deadline = requests[-1].offset_s + request_timeout_s
        records = asyncio.run(run_open_loop(url, requests, request_timeout_s, deadline))
        after = asyncio.run(scrape_text(url))
        stages = {kind: stage_means(stage_totals(before, kind), stage_totals(after, kind))
                  for kind in ("image", "video")}
        return PolicyRun(records, run_means(histogram_totals(before), histogram_totals(after)),
                         {kind: means for kind, means in stages.items() if means})


def by_steps(records: list[RequestRecord]) -> dict[int, Summary]:
    """Per step count: a mixed workload's tail is mostly its longest requests."""
    return {s: summarize([r for r in records if r.steps == s]) for s in sorted({r.steps for r in records})}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def print_table(summaries: dict[str, Summary], runs: dict[str, PolicyRun], offered_rps: float) -> None:
    print(f"\noffered load {offered_rps:g} req/s; latencies in ms, from scheduled send to response; "
          f"batch and round: router means over the run")
    print(f"{'policy':<14}{'ok/count':>10}{'req/s':>8}{'mean':>8}{'P50':>8}{'P95':>8}{'P99':>8}"
          f"{'send lag':>10}{'batch':>7}{'round':>7}")
    for policy, s in summaries.items():
        server = runs[policy].server
        batch = server["batch_size"]["mean"]
        print(f"{policy:<14}{f'{s.ok}/{s.count}':>10}{s.throughput_rps:>8.2f}{_ms(s.latency_mean_s):>8}"
              f"{_ms(s.latency_p50_s):>8}{_ms(s.latency_p95_s):>8}{_ms(s.latency_p99_s):>8}"
              f"{_ms(s.max_send_lag_s):>10}{'-' if batch is None else f'{batch:.2f}':>7}"
              f"{_ms(server['round_s']['mean']):>7}")


def p95_ratio(summaries: dict[str, Summary]) -> float | None:
    if "continuous" not in summaries or "static_fcfs" not in summaries:
        return None
    continuous, static = summaries["continuous"].latency_p95_s, summaries["static_fcfs"].latency_p95_s
    return None if continuous is None or not static else continuous / static


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_config = load_serve_config(args.config)
    mix = dict(steps_choices=tuple(args.steps), width=args.size, height=args.size, guidance_scale=args.guidance)
    workload = PoissonWorkload(rate=args.rate, duration_s=args.duration, seed=args.seed, **mix)
    requests = generate(workload)
    # Same mix, another seed: warm-up reaches every code path without replaying measured requests.
    warmup: list[ScheduledRequest] = []
    if args.warmup:
        warmup = generate(PoissonWorkload(rate=args.rate, num_requests=args.warmup, seed=args.seed + 1, **mix))
    print(f"{len(requests)} requests over {args.duration:g} s per policy; policies: {', '.join(args.policies)}",
          file=sys.stderr)

    runs: dict[str, PolicyRun] = {}
    port = free_port()  # one for all apps: Serve keeps the HTTP options it first started with
    with local_ray(args.num_cpus):
        for policy in args.policies:
            print(f"[{policy}] deploying, warming up, running...", file=sys.stderr)
            started = time.monotonic()
            runs[policy] = run_policy(base_config, port, policy, warmup, requests, args.request_timeout)
            print(f"[{policy}] done in {time.monotonic() - started:.0f} s", file=sys.stderr)

    records = {policy: run.records for policy, run in runs.items()}
    summaries = {policy: summarize(recs) for policy, recs in records.items()}
    ratio = p95_ratio(summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "batching",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "ray_num_cpus": args.num_cpus},
        "config_path": str(args.config),
        "app_args": base_config["applications"][0].get("args", {}),
        "workload": {**asdict(workload), "num_requests": len(requests), "warmup_requests": len(warmup),
                     "request_timeout_s": args.request_timeout},
        "p95_ratio_continuous_over_static": ratio,
        "target_p95_ratio": TARGET_P95_RATIO,
        "policies": {
            policy: {
                "summary": asdict(summaries[policy]),
                "by_steps": {str(s): asdict(v) for s, v in by_steps(records[policy]).items()},
                "server": runs[policy].server,
                "records": [asdict(r) for r in records[policy]],
            }
            for policy in records
        },
    }
    (args.out / "batching.json").write_text(json.dumps(result, indent=1))
    title = (f"{args.size}x{args.size}, steps {'/'.join(map(str, args.steps))}, Poisson {args.rate:g} req/s "
             f"for {args.duration:g} s, seed {args.seed}")
    plot_batching(records, summaries, args.rate, title, args.out / "batching.png")

    print_table(summaries, runs, args.rate)
    for policy, s in summaries.items():
        if s.failed:
            print(f"warning: {policy} had {s.failed} failed requests; its percentiles cover successes only")
    if ratio is not None:
        verdict = "meets" if ratio <= TARGET_P95_RATIO else "misses"
        print(f"P95 continuous / static_fcfs = {ratio:.2f} ({verdict} the {TARGET_P95_RATIO} target)")
    print(f"wrote {args.out / 'batching.json'} and {args.out / 'batching.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
