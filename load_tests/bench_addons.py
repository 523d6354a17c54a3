"""Requests with ControlNets and LoRAs, live: stepserve against add-ons served inside each
denoiser the diffusers way (SwiftDiffusion's DIFFUSERS baseline), same requests, same weights.

The workload is the configured one (Poisson), each request given add-ons by SwiftDiffusion's
production mix (Table 1, service A or B): ControlNets from the config's (skewed popularity),
LoRAs from a catalog of `--loras` LoRA files written for the run (long-tailed popularity). Every
image goes through the official `openai` client, add-ons in `extra_body`. Systems:

- stepserve: the config as it is (ControlNets in the workers' batches, LoRAs from the per-node
  store, joining exactly at step 0 by default; `--service` adds a run with the ControlNet
  service and `--join-by` one with late LoRAs);
- stepserve-preloaded: every LoRA on every worker from the start (`lora_loading.preload`): the
  paired latency difference to stepserve is what loading LoRAs on demand costs a request;
- stepserve-no-lora: the same requests without their LoRAs: the paired difference to the
  preloaded run is what applying them costs;
- diffusers: the peer of load_tests/peers.py, one request at a time per replica: the
  ControlNet pipeline, each LoRA read from its file and fused per request, unfused after.

Systems take turns per repeat, reversed every other repeat (the VM's speed drifts).

    python -m stepserve.load_tests.bench_addons --out docs/results/addons

Writes addons.json and addons.png.
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

from prometheus_client.parser import text_string_to_metric_families
from stepserve.deployments.config import AppConfig
from stepserve.engine.addons.presets import preset_lora, save_lora_file
from stepserve.engine.families import DENOISER, load_family
from stepserve.load_tests.addon_mix import SERVICES, AddonMix, with_addons
from stepserve.load_tests.bench_peers import peer_config
from stepserve.load_tests.live import run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import summarize
from stepserve.load_tests.plots import plot_addons
from stepserve.load_tests.server_metrics import scrape_text
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.runtime import tiny_config_path, load_serve_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_addons", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for addons.json, addons.png and the LoRAs")
    parser.add_argument("--config", type=Path, default=tiny_config_path(), help="stepserve's Serve config")
    parser.add_argument("--workload", default="local-tiny", help="request mix and SLOs (default: %(default)s)")
    parser.add_argument("--profile", default="tiny-sd-cpu", help="profile the SLOs are computed from")
    parser.add_argument("--service", choices=sorted(SERVICES), default="B", help="Table 1's add-on mix")
    parser.add_argument("--loras", type=int, default=24, help="LoRA files in the catalog (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=1.5, help="offered req/s (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--controlnet-service", action="store_true", help="also run stepserve with the ControlNet "
                                                                           "service (its own process)")
    parser.add_argument("--join-by", type=float, default=None, help="also run stepserve with lora_loading.join_by")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    return parser.parse_args(argv)


def write_loras(base: dict[str, Any], folder: Path, count: int) -> list[dict[str, Any]]:
    """`count` LoRA files for the config's first model (its preset's shapes): config entries."""
    model = AppConfig.model_validate(base["applications"][0]["args"]).models[0]
    denoiser = load_family(model.to_source(), {DENOISER}).denoiser
    entries = []
    for i in range(count):
        name = f"style-{i:03d}"
        save_lora_file(preset_lora(name, denoiser, seed=100 + i), str(folder / name))
        entries.append({"name": name, "model": model.name, "path": str(folder / name)})
    return entries


def system_configs(base: dict[str, Any], port: int, loras: list[dict[str, Any]],
                   args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    stepserve = bench_serve_config(base, port)
    app = stepserve["applications"][0]["args"]
    app["loras"] = loras
    configs = {"stepserve": stepserve}
    preloaded = copy.deepcopy(stepserve)
    preloaded["applications"][0]["args"]["lora_loading"] = {"preload": True}
    configs["stepserve-preloaded"] = preloaded
    if args.controlnet_service:
        service = copy.deepcopy(stepserve)
        service["applications"][0]["args"]["controlnet_service"] = {
            "enabled": True, "num_cpus": 0, "torch_threads": 1, "device": "cpu"}
        configs["stepserve-cn-service"] = service
    if args.join_by is not None:
        late = copy.deepcopy(stepserve)
        late["applications"][0]["args"]["lora_loading"] = {"join_by": args.join_by}
        configs[f"stepserve-join-{args.join_by:g}"] = late
    diffusers = peer_config(base, port, "per_request", 0.0)
    peer = diffusers["applications"][0]["args"]
    peer["controlnets"] = app.get("controlnets", [])
    peer["loras"] = loras
    configs["diffusers"] = diffusers
    return configs


def lora_waits(exposition: str) -> dict[str, float]:
    """stepserve's `stepserve_lora_wait_seconds` sums by where (queue, batch)."""
    out = {"queue": 0.0, "batch": 0.0}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "stepserve_lora_wait_seconds_sum":
                out[sample.labels["where"]] += sample.value
    return out


def run_system(name: str, config: dict[str, Any], requests: list, args: argparse.Namespace) -> dict[str, Any]:
    measured = name.startswith("stepserve")  # its own account of the time LoRA loading took
    with deployed(config) as url:
        asyncio.run(wait_ready(url))
        warm = requests[:args.warmup]
        warm = [replace(r, offset_s=0.5 * i) for i, r in enumerate(warm)]
        asyncio.run(run_open_loop(url, warm, args.request_timeout, warm[-1].offset_s + args.request_timeout,
                                  via_openai=True))
        time.sleep(2.0)
        before = lora_waits(asyncio.run(scrape_text(url))) if measured else None
        records = asyncio.run(run_open_loop(url, requests, args.request_timeout,
                                            requests[-1].offset_s + args.request_timeout, via_openai=True))
        after = lora_waits(asyncio.run(scrape_text(url))) if measured else None
    summary = summarize(records)
    failed = [r.error for r in records if not r.ok][:3]
    log(f"[{name}] P50 {summary.latency_p50_s} P95 {summary.latency_p95_s} ok {summary.ok}/{summary.count} {failed}")
    out = {"summary": asdict(summary), "latencies": [r.latency_s if r.ok else None for r in records]}
    if measured:
        waits = {where: after[where] - before[where] for where in after}
        total = sum(r.latency_s for r in records if r.ok)
        out["lora_wait_s"] = waits
        # What waiting for LoRAs to load cost all requests together, against all their latency.
        out["lora_loading_share"] = (waits["queue"] + waits["batch"]) / total if total else None
        log(f"[{name}] LoRA loading: queue {waits['queue']:.2f} s, batch {waits['batch']:.2f} s, "
            f"{out['lora_loading_share']:.2%} of all latency")
    return out


def lora_overhead(with_loras: list[float | None], without: list[float | None], requests: list) -> dict[str, Any]:
    """Per request with LoRAs, paired with itself without them: what its LoRAs added."""
    pairs = [(w, o) for w, o, r in zip(with_loras, without, requests) if r.loras and w is not None and o is not None]
    if not pairs:
        return {"requests": 0}
    added = [w - o for w, o in pairs]
    return {"requests": len(pairs), "median_added_s": statistics.median(added),
            "mean_added_s": statistics.mean(added),
            "median_fraction_of_latency": statistics.median(a / w for a, (w, _) in zip(added, pairs)),
            "mean_fraction": statistics.mean(added) / statistics.mean(w for w, _ in pairs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = load_serve_config(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    loras = write_loras(base, args.out / "loras", args.loras)
    controlnets = [c["name"] for c in base["applications"][0]["args"].get("controlnets", [])]
    mix = AddonMix.service(args.service, controlnets, [entry["name"] for entry in loras])
    spec = load_workload(args.workload)
    cost = load_profile(args.profile)
    runs: dict[str, list[dict[str, Any]]] = {}
    workloads = []  # each repeat's requests
    port = free_port()
    with local_ray(args.num_cpus):
        configs = system_configs(base, port, loras, args)
        names = list(configs) + ["stepserve-no-lora"]
        for repeat in range(args.repeats):
            plain = generate(replace(spec.with_rate(args.rate), seed=spec.seed + 1000 * repeat,
                                     duration_s=args.duration, num_requests=None), cost)
            requests = with_addons(plain, mix, seed=repeat)
            workloads.append(requests)
            stripped = [replace(r, loras=()) for r in requests]
            for name in (names if repeat % 2 == 0 else names[::-1]):
                config = configs["stepserve" if name == "stepserve-no-lora" else name]
                run = run_system(name, config, stripped if name == "stepserve-no-lora" else requests, args)
                runs.setdefault(name, []).append({"repeat": repeat, **run})
    overhead = [{"loading": lora_overhead(runs["stepserve"][repeat]["latencies"],
                                          runs["stepserve-preloaded"][repeat]["latencies"], requests),
                 "applying": lora_overhead(runs["stepserve-preloaded"][repeat]["latencies"],
                                           runs["stepserve-no-lora"][repeat]["latencies"], requests)}
                for repeat, requests in enumerate(workloads)]
    report = {
        "benchmark": "addons", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "config_path": str(args.config), "workload": args.workload, "addon_mix": args.service,
        "lora_catalog": args.loras, "rate_rps": args.rate, "duration_s": args.duration, "repeats": args.repeats,
        "systems": runs, "lora_overhead": overhead,
        "requests": [[{"controlnets": r.controlnets, "loras": r.loras, "steps": r.num_inference_steps}
                      for r in requests] for requests in workloads],
    }
    (args.out / "addons.json").write_text(json.dumps(report, indent=1, default=str))
    plot_addons(runs, overhead, f"{args.workload} + Table 1 service {args.service} add-ons, {args.rate:g} req/s",
                args.out / "addons.png")
    for name, system_runs in runs.items():
        print(f"{name}: P50 ms {'; '.join(_ms(r['summary']['latency_p50_s']) for r in system_runs)}, "
              f"P95 ms {'; '.join(_ms(r['summary']['latency_p95_s']) for r in system_runs)}, ok "
              f"{'; '.join(str(r['summary']['ok']) for r in system_runs)}")
        shares = [r["lora_loading_share"] for r in system_runs if r.get("lora_loading_share") is not None]
        if shares:
            print(f"{name}: LoRA loading's share of all latency {'; '.join(f'{x:.2%}' for x in shares)}")
    for repeat, o in enumerate(overhead):
        print(f"LoRA overhead, repeat {repeat}: {o}")
    print(f"wrote {args.out / 'addons.json'} and {args.out / 'addons.png'}")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


if __name__ == "__main__":
    sys.exit(main())
