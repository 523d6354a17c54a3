"""Add-ons at GPU magnitude, simulated (SwiftDiffusion §6.3, §6.6): SDXL on 8 denoiser workers,
the live `RouterCore` and policy, time from a profile with add-on rows (`sdxl-h800`: derived).

1. ControlNet parallelism: Poisson requests that each carry exactly m ControlNets (m = 1, 3),
   served with the ControlNets run by each denoiser before its UNet (`inline`, the diffusers
   way), on the ControlNet service beside the UNet's encoder half (`service`, exact) and one step
   stale (`stale`). The speed-up of a request's mean denoising step over `inline`, at a light
   load (requests mostly alone, as the paper measures it) and at a heavy one, against Gustafson's
   ideal for one request (the critical path with free transfers: `addon_costs.ideal_seconds`).
2. Mixed-LoRA batches: the paper's add-on mix (Table 1, services A and B) over a long-tailed
   catalog of LoRAs, every request at once, with forwards that mix LoRAs (stepserve) and with one
   adapter set per forward (`lora_batches: per_adapter`, the way vLLM-Omni and SGLang batch):
   throughput in images per minute of denoiser GPU time, and the latency of a Poisson run of each;
   and stepserve without LoRA-affinity placement (`lora_affinity_s: 0`): how often a LoRA is
   brought to a worker (each stalls that worker's batch for the profile's `lora_load`); and the
   composed policy (`configs/cluster.yaml`'s) on the same requests.

    python -m stepserve.load_tests.bench_addons_sim --out docs/results/addons-sim

Writes addons_sim.json and addons_sim.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.addon_mix import SERVICES, AddonMix, with_addons
from stepserve.load_tests.plots import plot_addons_sim
from stepserve.load_tests.sim.services import TextEncoderSpec
from stepserve.load_tests.sim.simulator import SimConfig, SimResult, simulate
from stepserve.load_tests.workload import PoissonWorkload, ScheduledRequest, generate
from stepserve.policies.addon_costs import ControlNetPlacement, forward_seconds, ideal_seconds
from stepserve.policies.cost_model import BatchShape, ProfiledCostModel, read_profile, resolve_profile
from stepserve.policies.types import LoraBatching

PAPER_CONTROLNETS = {1: (1.42, 1.45), 3: (2.2, 2.35)}  # m: (achieved, Gustafson ideal), §6.3
CONTROLNETS = ("canny", "depth", "openpose")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_addons_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", default="sdxl-h800", help="needs controlnet, denoise_encoder and lora rows")
    parser.add_argument("--model", default="stable-diffusion-xl-base-1.0", help="the profile's model name")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50, help="SwiftDiffusion §6.1: 50")
    parser.add_argument("--light-rate", type=float, default=0.2, help="req/s where requests are mostly alone")
    parser.add_argument("--heavy-rate", type=float, default=1.5, help="req/s of the loaded ControlNet run")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of Poisson arrivals a run")
    parser.add_argument("--loras", type=int, default=200, help="LoRAs in the catalog (long-tailed)")
    parser.add_argument("--services", default="A,B", help="Table 1's add-on mixes to run")
    parser.add_argument("--burst", type=int, default=480, help="requests at once for the throughput runs")
    parser.add_argument("--lora-rate", type=float, default=2.2, help="req/s of the LoRA latency runs")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def sim_config(args: argparse.Namespace, **changes: Any) -> SimConfig:
    # A GPU cluster: a VAE decoder and a text encoder replica per two workers, queues that hold a burst.
    return replace(SimConfig(workers=args.workers, max_batch_size=args.max_batch_size, decoders=args.workers // 2,
                             text_encoder=TextEncoderSpec(replicas=max(1, args.workers // 4)),
                             max_queued_images=10 * args.burst), **changes)


def poisson(args: argparse.Namespace, rate: float, seed: int, count: int | None = None) -> list[ScheduledRequest]:
    """`args.duration` seconds of arrivals, or `count` requests."""
    return generate(PoissonWorkload(rate=rate, duration_s=None if count else args.duration, num_requests=count,
                                    steps_choices=(args.steps,), width=args.size, height=args.size, model=args.model,
                                    seed=seed))


def finished(result: SimResult) -> list:
    done = [t for t in result.traces if t.status == "finished"]
    if not done:
        raise RuntimeError("no request finished")
    return done


def step_and_latency(result: SimResult) -> dict[str, float]:
    done = finished(result)
    latencies = sorted(t.latency_s for t in done)
    return {"requests": len(done), "step_mean_s": statistics.mean((t.finish_s - t.admit_s) / t.steps for t in done),
            "latency_mean_s": statistics.mean(latencies), "latency_p50_s": statistics.median(latencies),
            "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
            "controlnet_busy_s": result.controlnet_busy_s, "end_s": result.end_s,
            # The service is priced with a device free for every call: this is how many it keeps busy.
            "controlnet_devices_busy": result.controlnet_busy_s / result.end_s}


def controlnet_runs(rows: list, args: argparse.Namespace) -> list[dict[str, Any]]:
    costs = {p: ProfiledCostModel(rows, p) for p in ControlNetPlacement}
    out = []
    for m in (1, 3):
        # Gustafson's ideal for one request alone (CFG: 2 rows), from the profile's parts.
        parts = costs[ControlNetPlacement.INLINE].forward_parts(
            BatchShape(args.model, args.size, args.size, 2, controlnet_rows=(2,) * m))
        sequential = forward_seconds(*parts, ControlNetPlacement.INLINE)
        entry: dict[str, Any] = {"controlnets": m, "ideal_speedup": sequential / ideal_seconds(*parts),
                                 "paper": dict(zip(("achieved", "ideal"), PAPER_CONTROLNETS[m])), "loads": {}}
        for load, rate in (("light", args.light_rate), ("heavy", args.heavy_rate)):
            requests = [replace(r, controlnets=CONTROLNETS[:m]) for r in poisson(args, rate, args.seed)]
            runs = {p.value: step_and_latency(simulate(requests, costs[p], sim_config(args))) for p in costs}
            inline = runs[ControlNetPlacement.INLINE.value]
            for placement in (ControlNetPlacement.SERVICE, ControlNetPlacement.STALE):
                run = runs[placement.value]
                run["step_speedup"] = inline["step_mean_s"] / run["step_mean_s"]
                run["latency_speedup"] = inline["latency_mean_s"] / run["latency_mean_s"]
                if load == "light":  # the ideal is one request's; a loaded inline system also queues
                    run["of_ideal"] = run["step_speedup"] / entry["ideal_speedup"]
            entry["loads"][load] = {"rate_rps": rate, "runs": runs}
        out.append(entry)
    return out


def lora_systems(args: argparse.Namespace) -> dict[str, SimConfig]:
    """stepserve (mixed-LoRA forwards, LoRA-affinity placement), the same without affinity, one
    adapter set a forward, and the composed policy (mixed-LoRA forwards, no affinity: the
    cluster's policy on SwiftDiffusion's own workload)."""
    return {"mixed": sim_config(args),
            "mixed, no affinity": sim_config(args, policy_options={"lora_affinity_s": 0.0}),
            "per_adapter": sim_config(args, lora_batches=LoraBatching.PER_ADAPTER),
            "composed": sim_config(args, policy="composed")}


def lora_runs(rows: list, args: argparse.Namespace) -> list[dict[str, Any]]:
    cost = ProfiledCostModel(rows, ControlNetPlacement.SERVICE)
    catalog = [f"lora-{i:03d}" for i in range(args.loras)]
    out = []
    for service in args.services.split(","):
        mix = AddonMix.service(service, CONTROLNETS, catalog)
        burst = with_addons([replace(r, offset_s=0.0) for r in poisson(args, 1.0, args.seed, args.burst)], mix,
                            args.seed)
        steady = with_addons(poisson(args, args.lora_rate, args.seed + 1), mix, args.seed + 1)
        entry: dict[str, Any] = {"service": service, "mix": SERVICES[service], "burst": len(burst), "runs": {}}
        for name, config in lora_systems(args).items():
            result = simulate(burst, cost, config)
            done = finished(result)
            makespan = max(t.completion_s for t in done)
            steady_result = simulate(steady, cost, config)
            entry["runs"][name] = {
                "images_per_gpu_minute": 60 * len(done) / (makespan * args.workers),
                "makespan_s": makespan, "finished": len(done),
                "requests_per_forward": sum(t.steps for t in done) / result.forwards,
                "steady": {"rate_rps": args.lora_rate, **step_and_latency(steady_result),
                           "lora_loads_per_request": steady_result.lora_loads / len(steady)}}
        runs = entry["runs"]
        entry["throughput_gain"] = runs["mixed"]["images_per_gpu_minute"] / runs["per_adapter"]["images_per_gpu_minute"]
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = read_profile(resolve_profile(args.profile))
    report = {"benchmark": "addons_sim", "profile": args.profile, "model": args.model, "workers": args.workers,
              "max_batch_size": args.max_batch_size, "size": args.size, "steps": args.steps,
              "duration_s": args.duration, "lora_catalog": args.loras,
              "controlnets": controlnet_runs(rows, args), "loras": lora_runs(rows, args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "addons_sim.json").write_text(json.dumps(report, indent=1))
    plot_addons_sim(report, args.out / "addons_sim.png")
    for entry in report["controlnets"]:
        for load, at in entry["loads"].items():
            for name in ("service", "stale"):
                run = at["runs"][name]
                of_ideal = f" ({run['of_ideal']:.0%} of ideal {entry['ideal_speedup']:.2f}x)" if "of_ideal" in run else ""
                print(f"{entry['controlnets']} ControlNet(s), {load} ({at['rate_rps']} req/s), {name}: step "
                      f"{run['step_speedup']:.2f}x{of_ideal}, latency {run['latency_speedup']:.2f}x, "
                      f"{run['controlnet_devices_busy']:.1f} service GPUs busy; paper "
                      f"{entry['paper']['achieved']}x of {entry['paper']['ideal']}x")
    for entry in report["loras"]:
        runs = entry["runs"]
        print(f"service {entry['service']}: " + "; ".join(
            f"{name} {run['images_per_gpu_minute']:.1f} images/GPU-min, {run['requests_per_forward']:.2f} requests a "
            f"forward, steady P50/P95 {run['steady']['latency_p50_s']:.2f}/{run['steady']['latency_p95_s']:.2f} s, "
            f"{run['steady']['lora_loads_per_request']:.2f} LoRA loads a request"
            for name, run in runs.items()) + f"; mixed/per-adapter {entry['throughput_gain']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
