"""stepserve against what users deploy instead, side by side on the same machine and load.

The peers (load_tests/peers.py) are Ray Serve's Stable Diffusion example pattern with
stepserve's own weights and replica layout: one pipeline call per request (`per_request`), or
per `@serve.batch` group (`batched`). Each system is deployed in turn on one lean local Ray and
driven open-loop with the same request lists (one per rate and repeat, Poisson, the workload's
mix and SLOs). The systems take turns per repeat, in reverse order every other repeat
(A B C, C B A, ...): the VM's speed drifts by tens of percent within an hour, and back-to-back
repeats of one system would hand that drift to the comparison. Per point: P50/P95/P99,
throughput, SLO attainment, the load generator's send lag, the CPU seconds of every Ray process (the whole
server: proxy, replicas, raylet, GCS) per request, in all and per process, and for stepserve the queue wait and the
per-stage timeline of an image (ingress, text encoding, queue, steps, decode) from its /metrics.
Once per system and repeat: the idle CPU of the whole app, per process (the median repeat is
reported). Once per run: the idle CPU of Ray and Serve with no app deployed (the floor every
system's idle includes), of stepserve's processes with nothing in them (`process_floor.py`: what
Ray and Serve charge for its layout alone), and a bare in-process pipeline call per step count,
the floor any server adds its hops to.

    python -m stepserve.load_tests.bench_peers --out docs/results/peers
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from ray import serve

from stepserve.deployments.config import AppConfig
from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.host_cpu import ray_process_cpu
from stepserve.load_tests.live import run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import percentile, summarize
from stepserve.load_tests.plots import plot_peers
from stepserve.load_tests.server_metrics import histogram_totals, run_means, scrape_text, stage_means, stage_totals
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.runtime import tiny_config_path, load_serve_config

SYSTEMS = ("stepserve", "per_request", "batched")
IDLE_S = 20.0  # seconds the deployed, warmed-up app is left alone to measure its idle CPU


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for peers.json and peers.png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(),
                        help="stepserve's Serve config; the peers take its first model and worker layout "
                             "(default: %(default)s)")
    parser.add_argument("--workload", default="local-tiny", help="request mix and SLOs (default: %(default)s)")
    parser.add_argument("--profile", default="tiny-sd-cpu", help="profile the SLOs are computed from")
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10], help="offered req/s")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system and rate (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--batch-wait", type=float, default=0.5, help="the batched peer's batch_wait_timeout_s")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request counts as lost")
    parser.add_argument("--warmup", type=int, default=8, help="requests before each system's runs")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs the local Ray may use")
    return parser.parse_args(argv)


def peer_config(base: dict[str, Any], port: int, mode: str, batch_wait_s: float) -> dict[str, Any]:
    """A Serve config of the peer with stepserve's first model and worker layout."""
    app = AppConfig.model_validate(base["applications"][0]["args"])
    workers = app.workers
    config = copy.deepcopy(bench_serve_config(base, port))
    config["applications"] = [{
        "name": "peer", "route_prefix": "/", "import_path": "stepserve.load_tests.peers:build_peer_app",
        "args": {"model": app.models[0].model_dump(), "mode": mode, "num_replicas": workers.num_workers,
                 "num_cpus": workers.num_cpus, "torch_threads": workers.torch_threads or 1,
                 "max_batch_size": workers.max_batch_size, "batch_wait_timeout_s": batch_wait_s,
                 "ingress_num_cpus": app.ingress.num_cpus},
    }]
    return config


def cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per process title between two `ray_process_cpu` readings, largest first (a
    title shared by several processes is summed; a process that started in between is left out)."""
    per_title: dict[str, float] = {}
    for pid, (title, cpu) in after.items():
        if pid in before:
            per_title[title] = per_title.get(title, 0.0) + cpu - before[pid][1]
    return dict(sorted(per_title.items(), key=lambda item: -item[1]))


def idle_cpu(seconds: float = IDLE_S) -> dict[str, Any]:
    """Cores every Ray process burns over `seconds` left alone, in all and per process title."""
    before = ray_process_cpu()
    time.sleep(seconds)
    processes = {title: cpu / seconds for title, cpu in cpu_between(before, ray_process_cpu()).items()}
    return {"cores": sum(processes.values()), "processes": processes}


def process_floor_idle(base: dict[str, Any], port: int) -> dict[str, Any]:
    """Idle CPU of stepserve's process layout with nothing in it (`process_floor.py`): what Ray
    and Serve charge for stepserve's processes alone."""
    config = bench_serve_config(base, port)
    config["applications"][0]["import_path"] = "stepserve.load_tests.process_floor:build_floor_app"
    with deployed(config) as url:
        asyncio.run(wait_ready(url))
        time.sleep(2.0)
        return idle_cpu()


def bare_pipeline_seconds(base: dict[str, Any], prompt: str, size: tuple[int, int], steps: list[int],
                          guidance: float) -> dict[int, float]:
    """One plain pipeline call in this process, per step count (median of 3): the floor."""
    app = AppConfig.model_validate(base["applications"][0]["args"])
    torch.set_num_threads(app.workers.torch_threads or 1)
    pipe = load_family(app.models[0].to_source(), ALL_PARTS, "cpu").pipe
    out = {}
    for n in steps:
        times = []
        for seed in range(4):
            started = time.perf_counter()
            pipe(prompt, width=size[0], height=size[1], num_inference_steps=n, guidance_scale=guidance,
                 generator=torch.Generator().manual_seed(seed), output_type="np")
            times.append(time.perf_counter() - started)
        out[n] = statistics.median(times[1:])  # the first call warms up
    return out


def run_point(url: str, requests, args: argparse.Namespace, with_metrics: bool) -> dict[str, Any]:
    before = asyncio.run(scrape_text(url)) if with_metrics else None
    cpu_before = ray_process_cpu()
    records = asyncio.run(run_open_loop(url, requests, args.request_timeout,
                                        requests[-1].offset_s + args.request_timeout))
    by_process = cpu_between(cpu_before, ray_process_cpu())
    cpu = sum(by_process.values())
    summary = summarize(records)
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    point = {**asdict(summary), "server_cpu_s": cpu, "cpu_per_request_s": cpu / len(records),
             "cpu_per_request_by_process_s": {title: c / len(records) for title, c in by_process.items()},
             "send_lag_p95_s": percentile(lags, 95) if lags else None}
    if with_metrics:
        after = asyncio.run(scrape_text(url))
        point["server"] = run_means(histogram_totals(before), histogram_totals(after))
        point["queue_wait_mean_s"] = point["server"]["queue_wait_s"]["mean"]
        point["stages_s"] = stage_means(stage_totals(before), stage_totals(after))
    return point


def run_system(name: str, config: dict[str, Any], loads: dict[tuple[float, int], list],
               args: argparse.Namespace, spec, cost) -> dict[str, Any]:
    with deployed(config) as url:
        asyncio.run(wait_ready(url))
        warm = generate(replace(spec.with_rate(2.0), seed=spec.seed + 99, duration_s=None,
                                num_requests=args.warmup), cost)
        asyncio.run(run_open_loop(url, warm, args.request_timeout, warm[-1].offset_s + args.request_timeout))
        time.sleep(2.0)  # the warm-up's tail settles
        idle = idle_cpu()
        log(f"[{name}] idle: {idle['cores']:.3f} cores")
        points = []
        for (rate, repeat), requests in loads.items():
            point = run_point(url, requests, args, with_metrics=name == "stepserve")
            log(f"[{name}] {rate:g} req/s #{repeat}: P50 {_ms(point['latency_p50_s'])} P95 "
                f"{_ms(point['latency_p95_s'])} SLO {_pct(point['slo_attainment'])} ok {point['ok']}/"
                f"{point['count']} CPU/req {point['cpu_per_request_s'] * 1000:.0f} ms "
                f"lag {point['max_send_lag_s'] or 0:.2f} s")
            points.append({"rate": rate, "repeat": repeat, **point})
    return {"system": name, "idle_cores": idle["cores"], "idle_processes": idle["processes"], "points": points}


def merge_runs(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's deployments (one per repeat) as one result: every point, and the idle
    reading of the median repeat (each repeat's idle cores are kept too)."""
    idle = statistics.median_low([run["idle_cores"] for run in runs])
    median_run = next(run for run in runs if run["idle_cores"] == idle)
    return {"system": name, "idle_cores": idle, "idle_cores_runs": [run["idle_cores"] for run in runs],
            "idle_processes": median_run["idle_processes"], "points": [p for run in runs for p in run["points"]]}


def medians(points: list[dict[str, Any]], key: str) -> dict[float, float | None]:
    """Per rate, the median of `key` over the repeats (None when a repeat has none)."""
    by_rate: dict[float, list] = {}
    for p in points:
        by_rate.setdefault(p["rate"], []).append(p[key])
    return {rate: (None if any(v is None for v in vs) else statistics.median(vs)) for rate, vs in by_rate.items()}


def capacity_at(points: list[dict[str, Any]], slo: float = 0.9) -> float | None:
    """The highest rate whose median SLO attainment is >= `slo`, with every lower rate too."""
    best = None
    for rate, value in sorted(medians(points, "slo_attainment").items()):
        if value is None or value < slo:
            break
        best = rate
    return best


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = load_serve_config(args.config)
    spec = load_workload(args.workload)
    cost = load_profile(args.profile)
    loads = {(rate, repeat): generate(replace(spec.with_rate(rate), seed=spec.seed + 1000 * repeat + int(rate * 10),
                                              duration_s=args.duration, num_requests=None), cost)
             for rate in args.rates for repeat in range(args.repeats)}
    head = next(iter(loads.values()))[0]
    bare = bare_pipeline_seconds(base, head.prompt, (head.width, head.height),
                                 sorted({r.num_inference_steps for rs in loads.values() for r in rs}),
                                 head.guidance_scale)
    log("bare pipeline call: " + ", ".join(f"{n} steps {s * 1000:.0f} ms" for n, s in bare.items()))
    port = free_port()
    systems = []
    with local_ray(args.num_cpus):
        # What Ray and Serve burn with no app deployed (GCS, raylet, agents, controller, proxy):
        # every system's idle includes it, and no app can go below it.
        serve.start(http_options=bench_serve_config(base, port)["http_options"])
        time.sleep(2.0)
        floor = idle_cpu()
        log(f"idle with no app: {floor['cores']:.3f} cores")
        process_floor = process_floor_idle(base, port)
        log(f"idle with stepserve's processes doing nothing: {process_floor['cores']:.3f} cores")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
        for repeat in range(args.repeats):
            for name in (args.systems if repeat % 2 == 0 else args.systems[::-1]):
                config = (bench_serve_config(base, port) if name == "stepserve"
                          else peer_config(base, port, name, args.batch_wait))
                mine = {key: requests for key, requests in loads.items() if key[1] == repeat}
                runs[name].append(run_system(name, config, mine, args, spec, cost))
        systems = [merge_runs(name, system_runs) for name, system_runs in runs.items()]
    for system in systems:
        system["idle_above_floor_cores"] = system["idle_cores"] - floor["cores"]
        if system["system"] == "stepserve":
            system["idle_above_process_floor_cores"] = system["idle_cores"] - process_floor["cores"]
        system["capacity_at_90_slo_rps"] = capacity_at(system["points"])
        for key in ("latency_p50_s", "latency_p95_s", "latency_p99_s", "slo_attainment", "cpu_per_request_s",
                    "throughput_rps"):
            system[f"median_{key}"] = medians(system["points"], key)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "peers",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "config_path": str(args.config), "workload": args.workload, "profile": args.profile,
        "duration_s": args.duration, "repeats": args.repeats, "batch_wait_timeout_s": args.batch_wait,
        "bare_pipeline_s": {str(n): s for n, s in bare.items()},
        "bare_pipeline_mean_s": statistics.mean(bare[r.num_inference_steps] for rs in loads.values() for r in rs),
        "idle_floor_cores": floor["cores"], "idle_floor_processes": floor["processes"],
        "idle_process_floor_cores": process_floor["cores"], "idle_process_floor_processes": process_floor["processes"],
        "systems": systems,
    }
    (args.out / "peers.json").write_text(json.dumps(report, indent=1, default=str))
    plot_peers(systems, f"{args.workload}: stepserve vs the Ray Serve example pattern ({args.duration:g} s a run)",
               args.out / "peers.png")
    print(f"{'system':<13}{'rate':>6}{'P50 ms':>16}{'P95 ms':>16}{'SLO':>10}{'CPU/req ms':>12}")
    for system in systems:
        for rate in args.rates:
            runs = [p for p in system["points"] if p["rate"] == rate]
            print(f"{system['system']:<13}{rate:>6g} {'; '.join(_ms(p['latency_p50_s']) for p in runs):>15}"
                  f" {'; '.join(_ms(p['latency_p95_s']) for p in runs):>15}"
                  f" {'; '.join(_pct(p['slo_attainment']) for p in runs):>9}"
                  f"{statistics.median(p['cpu_per_request_s'] for p in runs) * 1000:>12.0f}")
        print(f"{system['system']:<13} capacity at 90% SLO: {system['capacity_at_90_slo_rps']} req/s; "
              f"idle {system['idle_cores']:.3f} cores, {system['idle_above_floor_cores']:.3f} above Ray and Serve "
              f"with no app ({floor['cores']:.3f})")
    stepserve_idle = next((system for system in systems if system["system"] == "stepserve"), None)
    if stepserve_idle is not None:
        print(f"stepserve idle above its own processes doing nothing ({process_floor['cores']:.3f}): "
              f"{stepserve_idle['idle_above_process_floor_cores']:.3f} cores")
    print(f"wrote {args.out / 'peers.json'} and {args.out / 'peers.png'}")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    sys.exit(main())
