"""Latent parallelism live (SwiftDiffusion §4.3): the same requests on `configs/local-tiny.yaml` served
with continuous batching and with the `latent_parallel` policy (a lone CFG image's two rows on
both workers, one gloo all-gather a step), side by side in one run, systems alternating.

Two loads: `light` (requests one at a time, each alone on the pool: every one splits) and
`loaded` (Poisson at a rate that keeps both workers busy: pairs come apart and requests batch).
Reports P50 / P95 latency per system and load, and how many steps ran split (the router's
`stepserve_split_steps`).

    python -m stepserve.load_tests.bench_latent_parallel --out docs/results/latent-parallel-live

Writes latent_parallel_live.json and latent_parallel_live.png.
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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stepserve.load_tests.live import run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import summarize
from stepserve.load_tests.plots import plot_latent_parallel_live
from stepserve.load_tests.server_metrics import scrape_text
from stepserve.load_tests.workload import PoissonWorkload, ScheduledRequest, generate
from stepserve.runtime import tiny_config_path, load_serve_config

SYSTEMS = ("continuous", "latent_parallel")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_latent_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=tiny_config_path())
    parser.add_argument("--profile", default="tiny-sd-cpu", help="the profile latent_parallel decides with")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--requests", type=int, default=12, help="requests per load and repeat")
    parser.add_argument("--gap", type=float, default=2.5, help="seconds between the light load's requests")
    parser.add_argument("--rate", type=float, default=3.0, help="req/s of the loaded run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    return parser.parse_args(argv)


def workloads(args: argparse.Namespace, repeat: int) -> dict[str, list[ScheduledRequest]]:
    base = generate(PoissonWorkload(rate=args.rate, num_requests=args.requests, steps_choices=(args.steps,),
                                    width=args.size, height=args.size, seed=1000 + repeat))
    return {"light": [replace(r, offset_s=i * args.gap) for i, r in enumerate(base)], "loaded": base}


def split_steps(exposition: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(exposition) for s in family.samples
               if s.name == "stepserve_split_steps_total" and s.labels.get("split") == "cfg")


def run_system(config: dict[str, Any], loads: dict[str, list[ScheduledRequest]],
               args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    with deployed(config) as url:
        asyncio.run(wait_ready(url))
        warm = loads["light"][:2]
        asyncio.run(run_open_loop(url, warm, args.request_timeout, warm[-1].offset_s + args.request_timeout))
        for load, requests in loads.items():
            before = split_steps(asyncio.run(scrape_text(url)))
            records = asyncio.run(run_open_loop(url, requests, args.request_timeout,
                                                requests[-1].offset_s + args.request_timeout))
            split = split_steps(asyncio.run(scrape_text(url))) - before
            summary = summarize(records)
            out[load] = {"summary": asdict(summary), "latencies": [r.latency_s if r.ok else None for r in records],
                         "split_share": split / (len(requests) * args.steps)}
            log(f"  {load}: P50 {summary.latency_p50_s:.3f} s, P95 {summary.latency_p95_s:.3f} s, "
                f"ok {summary.ok}/{summary.count}, {out[load]['split_share']:.0%} of steps split")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = load_serve_config(args.config)
    port = free_port()
    configs = {name: bench_serve_config(base, port, name) for name in SYSTEMS}
    for config in configs.values():
        config["applications"][0]["args"]["router"]["profiles"] = [args.profile]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    with local_ray(args.num_cpus):
        for repeat in range(args.repeats):
            loads = workloads(args, repeat)
            for name in (SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]):
                log(f"[{name}] repeat {repeat}")
                runs[name].append({"repeat": repeat, **run_system(configs[name], loads, args)})

    def median(name: str, load: str, key: str) -> float:
        return statistics.median(r[load]["summary"][key] for r in runs[name])

    ratios = {load: {q: median("continuous", load, q) / median("latent_parallel", load, q)
                     for q in ("latency_p50_s", "latency_p95_s")} for load in ("light", "loaded")}
    report = {"benchmark": "latent_parallel_live", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
              "config_path": str(args.config), "profile": args.profile, "size": args.size, "steps": args.steps,
              "requests": args.requests, "gap_s": args.gap, "rate_rps": args.rate, "repeats": args.repeats,
              "runs": runs, "speedup": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latent_parallel_live.json").write_text(json.dumps(report, indent=1))
    plot_latent_parallel_live(report, args.out / "latent_parallel_live.png")
    for load, ratio in ratios.items():
        print(f"{load}: continuous / latent_parallel P50 {ratio['latency_p50_s']:.2f}x, "
              f"P95 {ratio['latency_p95_s']:.2f}x; steps split "
              f"{statistics.median(r[load]['split_share'] for r in runs['latent_parallel']):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
