"""Overload, live: offered load at 3x capacity for a minute, shed at the edge.

For each admission setting the app from a Serve config (default: configs/local-tiny.yaml) is
deployed, warmed up and driven open-loop at `--factor` times the app's capacity for `--duration`
s with the workload's request mix and SLOs. The capacity is measured once first, with only the
count bound (open-loop well above it for `--probe-duration` s: what completes per second is
what the app can serve), so every setting meets the same offered load. Reported per setting:
how fast a rejection comes back (P50/P99 of the 429/503 answers), the goodput (requests that met
their SLO, per second) against the capacity, and the SLO attainment of the requests admitted.

    python -m stepserve.load_tests.bench_overload --out docs/results/overload

Settings (`--max-waits`): "none" keeps only the class's count bound (`router.max_queued_images`);
a number also rejects a request whose predicted queue wait exceeds it
(`router.max_image_queue_wait_s`), which is what keeps admitted requests inside their SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.live import run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import percentile, summarize
from stepserve.load_tests.plots import plot_overload
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.runtime import tiny_config_path, load_serve_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_overload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for overload.json and overload.png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(), help="Serve config (default: %(default)s)")
    parser.add_argument("--workload", default="local-tiny", help="request mix and SLOs (default: %(default)s)")
    parser.add_argument("--profile", default="tiny-sd-cpu", help="profile the SLOs are computed from")
    parser.add_argument("--max-waits", default="none,2,0.5", help="admission settings to compare (default: %(default)s)")
    parser.add_argument("--probe-rate", type=float, default=16.0, help="req/s of the capacity probe (default: %(default)s)")
    parser.add_argument("--probe-duration", type=float, default=30.0, help="seconds of the probe (default: %(default)s)")
    parser.add_argument("--factor", type=float, default=3.0, help="overload as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request counts as lost")
    parser.add_argument("--warmup", type=int, default=8, help="requests before each measured phase")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs the local Ray may use")
    return parser.parse_args(argv)


def with_max_wait(base: dict[str, Any], port: int, max_wait: float | None) -> dict[str, Any]:
    config = copy.deepcopy(bench_serve_config(base, port))
    router = config["applications"][0]["args"].setdefault("router", {})
    router["max_image_queue_wait_s"] = max_wait
    return config


def outcome(records: list[RequestRecord], capacity_rps: float, offered_rps: float) -> dict[str, Any]:
    rejected = [r for r in records if r.status in (429, 503)]
    admitted = [r for r in records if r.status not in (429, 503)]
    met = [r for r in admitted if r.met_slo]
    summary = summarize(admitted)
    span = summary.span_s or 1.0
    rejection_ms = [r.latency_s * 1000 for r in rejected if r.latency_s is not None]
    return {
        "offered_rps": offered_rps,
        "capacity_rps": capacity_rps,
        "requests": len(records),
        "rejected": len(rejected),
        "rejected_share": len(rejected) / len(records) if records else None,
        "rejection_ms_p50": percentile(rejection_ms, 50) if rejection_ms else None,
        "rejection_ms_p99": percentile(rejection_ms, 99) if rejection_ms else None,
        "admitted": len(admitted),
        "admitted_ok": summary.ok,
        "admitted_slo_attainment": len(met) / len(admitted) if admitted else None,
        "goodput_rps": len(met) / span,
        "goodput_over_capacity": len(met) / span / capacity_rps if capacity_rps else None,
        "admitted_latency_p50_s": summary.latency_p50_s,
        "admitted_latency_p95_s": summary.latency_p95_s,
        "max_send_lag_s": summarize(records).max_send_lag_s,
    }


def measure_capacity(base: dict[str, Any], port: int, args: argparse.Namespace, spec, cost) -> float:
    """What the app serves per second when offered far more, with only the count bound: the
    workers never wait for work, so completions per second are its capacity."""
    with deployed(with_max_wait(base, port, None)) as url:
        asyncio.run(wait_ready(url))
        warm_up(url, args, spec, cost)
        probe = generate(replace(spec.with_rate(args.probe_rate), duration_s=args.probe_duration, num_requests=None),
                         cost)
        log(f"capacity probe: {len(probe)} requests at {args.probe_rate:g} req/s")
        probed = asyncio.run(run_open_loop(url, probe, args.request_timeout, probe[-1].offset_s + args.request_timeout))
    served = [r for r in probed if r.ok]
    return len(served) / max(r.finished_s for r in served) if served else 0.0


def warm_up(url: str, args: argparse.Namespace, spec, cost) -> None:
    warmup = generate(replace(spec.with_rate(args.probe_rate / 4), seed=spec.seed + 1, duration_s=None,
                              num_requests=args.warmup), cost)
    asyncio.run(run_open_loop(url, warmup, args.request_timeout, warmup[-1].offset_s + args.request_timeout))


def run_setting(base: dict[str, Any], port: int, max_wait: float | None, capacity: float,
                args: argparse.Namespace, spec, cost) -> dict[str, Any]:
    label = "count bound only" if max_wait is None else f"max wait {max_wait:g} s"
    rate = args.factor * capacity
    load = generate(replace(spec.with_rate(rate), seed=spec.seed + 2, duration_s=args.duration, num_requests=None),
                    cost)
    with deployed(with_max_wait(base, port, max_wait)) as url:
        asyncio.run(wait_ready(url))
        warm_up(url, args, spec, cost)
        log(f"[{label}] overload: {len(load)} requests at {rate:.2f} req/s")
        records = asyncio.run(run_open_loop(url, load, args.request_timeout,
                                            load[-1].offset_s + args.request_timeout))
    result = outcome(records, capacity, rate)
    log(f"[{label}] " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    return {"label": label, "max_image_queue_wait_s": max_wait, **result,
            "records": [asdict(r) for r in records]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = load_serve_config(args.config)
    spec = load_workload(args.workload)
    cost = load_profile(args.profile)
    waits = [None if w.strip() == "none" else float(w) for w in args.max_waits.split(",")]
    port = free_port()
    with local_ray(args.num_cpus):
        capacity = measure_capacity(base, port, args, spec, cost)
        log(f"capacity {capacity:.2f} req/s")
        runs = [run_setting(base, port, w, capacity, args, spec, cost) for w in waits]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "overload",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "config_path": str(args.config), "workload": args.workload, "profile": args.profile,
        "factor": args.factor, "duration_s": args.duration, "runs": runs,
    }
    (args.out / "overload.json").write_text(json.dumps(report, indent=1))
    plot_overload(runs, f"{args.workload} at {args.factor:g}x capacity for {args.duration:g} s",
                  args.out / "overload.png")
    print(f"{'setting':<20}{'cap/s':>7}{'offered':>9}{'rejected':>10}{'rej P50 ms':>11}{'rej P99 ms':>11}"
          f"{'goodput/cap':>12}{'admitted SLO':>13}")
    for run in runs:
        print(f"{run['label']:<20}{run['capacity_rps']:>7.2f}{run['offered_rps']:>9.2f}"
              f"{run['rejected_share']:>10.0%}{_n(run['rejection_ms_p50']):>11}{_n(run['rejection_ms_p99']):>11}"
              f"{_n(run['goodput_over_capacity'], 2):>12}{_pct(run['admitted_slo_attainment']):>13}")
    print(f"wrote {args.out / 'overload.json'} and {args.out / 'overload.png'}")
    return 0


def _n(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    sys.exit(main())
