"""The simulator against the live system: the same requests, the same profile, side by side.

For each policy the app from a Serve config (default: configs/local.yaml) is deployed on a
lean local Ray, warmed up, and driven open-loop over HTTP with a workload's requests; the
simulator then runs exactly those requests (same offsets, steps, sizes) with the cluster
taken from the same config, timed by a cost profile, with every component sharing this
machine's CPUs (`SimConfig.host_cpus`). It prints both P50/P95 and the simulator's error.

    python -m stepserve.load_tests.sim_vs_live --out results/sim-vs-live

By default the profile is measured first (`stepserve profile` for the workload's models and
sizes, into <out>/profile.csv), on the same quiet machine, minutes before the live runs: the
2-core VM's speed drifts by tens of percent within an hour, so a profile from another time
compares two different machines. `--profile NAME_OR_CSV` uses an existing one instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.bench_batching import run_policy
from stepserve.load_tests.local_app import free_port, local_ray
from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.plots import plot_sim_vs_live
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.sweep import load_cost, parse_rates, sim_config_from_serve
from stepserve.load_tests.workload import generate, load_workload
from stepserve.runtime import default_config_path, load_serve_config

TOLERANCE = 0.15  # the bar for P50 and P95


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.sim_vs_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for sim_vs_live.json and .png")
    parser.add_argument("--config", type=Path, default=default_config_path(),
                        help="Serve config to deploy and to take the simulated cluster from (default: %(default)s)")
    parser.add_argument("--workload", default="local-tiny",
                        help="workload YAML or shipped name (default: %(default)s)")
    parser.add_argument("--profile", default="measure",
                        help="cost profile, a CSV path or shipped name, or 'measure' to profile this machine "
                             "first (default: %(default)s)")
    parser.add_argument("--rates", type=parse_rates, default=None,
                        help="offered rates, req/s, comma-separated (default: the workload's own)")
    parser.add_argument("--policies", nargs="+", default=["continuous"], help="policies to run (default: continuous)")
    parser.add_argument("--duration", type=float, default=None, help="override the workload's duration, s")
    parser.add_argument("--warmup", type=int, default=6, help="requests sent before each measured run")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request counts as failed")
    parser.add_argument("--host-cpus", type=float, default=os.cpu_count(),
                        help="cores the simulated app shares (default: this machine's, %(default)s)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="largest |sim/live - 1| for P50 and P95 counted as agreement (default: %(default)s)")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Comparison:
    policy: str
    rate: float
    live: Summary
    sim: Summary
    live_records: list[RequestRecord]
    sim_records: list[RequestRecord]
    server: dict[str, Any]  # the live router's histogram means

    def error(self, stat: str) -> float | None:
        """sim / live - 1 for a Summary field such as latency_p50_s."""
        live, sim = getattr(self.live, stat), getattr(self.sim, stat)
        return None if not live or sim is None else sim / live - 1

    def agrees(self, tolerance: float) -> bool:
        errors = [self.error("latency_p50_s"), self.error("latency_p95_s")]
        return all(e is not None and abs(e) <= tolerance for e in errors) and not self.live.failed


def measure_profile(args: argparse.Namespace, requests: list) -> list[Path]:
    """`stepserve profile` for every model in the requests, at their sizes, into one CSV each."""
    paths = []
    for model in sorted({r.model for r in requests}):
        sizes = sorted({max(r.width, r.height) for r in requests if r.model == model})
        path = args.out / f"profile-{model}.csv"
        command = [sys.executable, "-m", "stepserve.cli", "profile", "--model", model, "--device", "cpu",
                   "--config", str(args.config), "--sizes", *map(str, sizes), "--out", str(path)]
        log("measuring the profile: " + " ".join(command[2:]))
        subprocess.run(command, check=True)
        paths.append(path)
    return paths


def compare(args: argparse.Namespace) -> list[Comparison]:
    serve_config = load_serve_config(args.config)
    spec = load_workload(args.workload)
    if args.duration is not None:
        spec = replace(spec, duration_s=args.duration, num_requests=None)
    if args.profile == "measure":
        from stepserve.policies.cost_model import ProfiledCostModel

        args.profile = ",".join(map(str, measure_profile(args, generate(spec))))
        cost = ProfiledCostModel.from_csv(*args.profile.split(","))
    else:
        cost = load_cost(args.profile)
    sim_config = SimConfig(**{**sim_config_from_serve(args.config), "host_cpus": args.host_cpus})
    rates = args.rates or [spec.mean_rate]
    out: list[Comparison] = []
    port = free_port()  # one for all apps: Serve keeps the HTTP options it first started with
    with local_ray(int(os.cpu_count() or 1)):
        for policy in args.policies:
            for rate in rates:
                requests = generate(spec.with_rate(rate), cost)
                warmup = generate(replace(spec.with_rate(rate), seed=spec.seed + 1, duration_s=None,
                                          num_requests=args.warmup), cost) if args.warmup else []
                log(f"[{policy} @ {rate:g} req/s] live: {len(requests)} requests ...")
                started = time.monotonic()
                live = run_policy(serve_config, port, policy, warmup, requests, args.request_timeout)
                log(f"[{policy} @ {rate:g} req/s] live done in {time.monotonic() - started:.0f} s; simulating")
                result = simulate(requests, cost, replace(sim_config, policy=policy, policy_options={}))
                sim_records = result.records()
                out.append(Comparison(policy, rate, summarize(live.records, None, rate),
                                      summarize(sim_records, result.busy_s, rate), live.records, sim_records,
                                      live.server))
    return out


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(comparisons: list[Comparison], tolerance: float) -> None:
    print(f"\nlatency in s from scheduled send to response; error = sim / live - 1 (agreement: within "
          f"±{tolerance:.0%})")
    print(f"{'policy':<13}{'req/s':>6}{'ok':>9}{'live P50':>10}{'sim P50':>9}{'err':>8}"
          f"{'live P95':>10}{'sim P95':>9}{'err':>8}  agrees")
    for c in comparisons:
        print(f"{c.policy:<13}{c.rate:>6g}{f'{c.live.ok}/{c.live.count}':>9}{_s(c.live.latency_p50_s):>10}"
              f"{_s(c.sim.latency_p50_s):>9}{_pct(c.error('latency_p50_s')):>8}{_s(c.live.latency_p95_s):>10}"
              f"{_s(c.sim.latency_p95_s):>9}{_pct(c.error('latency_p95_s')):>8}  "
              f"{'yes' if c.agrees(tolerance) else 'NO'}")


def report(args: argparse.Namespace, comparisons: list[Comparison]) -> dict[str, Any]:
    return {
        "benchmark": "sim_vs_live",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "config_path": str(args.config), "workload": args.workload, "profile": str(args.profile),
        "host_cpus": args.host_cpus, "tolerance": args.tolerance,
        "runs": [
            {"policy": c.policy, "rate": c.rate, "agrees": c.agrees(args.tolerance),
             "error": {stat: c.error(stat) for stat in ("latency_p50_s", "latency_p95_s", "latency_p99_s",
                                                        "latency_mean_s")},
             "live": asdict(c.live), "sim": asdict(c.sim), "live_server": c.server,
             "live_records": [asdict(r) for r in c.live_records], "sim_records": [asdict(r) for r in c.sim_records]}
            for c in comparisons
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        comparisons = compare(args)
    except (ValueError, FileNotFoundError) as exc:  # bad workload, profile or config
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.out / "sim_vs_live.json").write_text(json.dumps(report(args, comparisons), indent=1))
    panels = {f"{c.policy} @ {c.rate:g} req/s": {"live": [r.latency_s for r in c.live_records if r.ok],
                                                   "simulated": [r.latency_s for r in c.sim_records if r.ok]}
              for c in comparisons}
    plot_sim_vs_live(panels, [(f"{c.policy} @ {c.rate:g}", c.error("latency_p50_s"), c.error("latency_p95_s"))
                              for c in comparisons], args.tolerance,
                     f"{args.workload}: simulated vs live, profile {args.profile}",
                     args.out / "sim_vs_live.png")
    print_table(comparisons, args.tolerance)
    print(f"wrote {args.out / 'sim_vs_live.json'} and {args.out / 'sim_vs_live.png'}")
    return 0 if all(c.agrees(args.tolerance) for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
