"""SynerDiff's served mechanisms, live on this machine: the embedded default (configs/local.yaml,
images decoded on their workers, which share this machine's cores with everything else: a real
contention) with VAE chunking (`vae_decoder.chunks`) and adaptive skip-CFG (the model's
`skip_cfg_quality`, on its measured `skip_cfg_curve`) switched on and off, at two load points,
driven open-loop over HTTP by the same seeded Poisson workload per variant, and with SynerDiff's
sequencer on the workers (`vae_decoder.sequencer_profile`, this machine's measured profile), last
with its load feedback controller (`vae_decoder.load_controller`) moving requests that ask
S = 0.98 toward the model's floor (0.95) as the queue builds.

    python -m stepserve.load_tests.bench_synerdiff_live --out docs/results/synerdiff-live

Writes synerdiff_live.json and synerdiff_live.png.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepserve.load_tests.live import run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import summarize
from stepserve.load_tests.workload import PoissonWorkload, generate
from stepserve.runtime import default_config_path, load_serve_config

# The shapes model's concurrency profile on this machine (`stepserve profile-concurrency`: c = 1 here).
PROFILE = "profiles/shapes-concurrency-cpu.csv"
VARIANTS = {  # name: (decode chunks, skip-CFG quality S, the sequencer's profile, its load controller)
    "naive (whole decodes, exact)": (1, 1.0, None, False),
    "VAE chunking": (3, 1.0, None, False),
    "skip-CFG (S = 0.95)": (1, 0.95, None, False),
    "chunking + skip-CFG": (3, 0.95, None, False),
    "sequencer + skip-CFG": (1, 0.95, PROFILE, False),
    "sequencer + controller (S = 0.98 to 0.95)": (1, 0.98, PROFILE, True),
}


def variant_config(base: dict[str, Any], port: int, chunks: int, quality: float,
                   profile: str | None, controller: bool) -> dict[str, Any]:
    config = copy.deepcopy(bench_serve_config(base, port))
    args = config["applications"][0]["args"]
    args["vae_decoder"] = {**args.get("vae_decoder", {}), "on_workers": True, "chunks": chunks,
                           "sequencer_profile": profile, "load_controller": controller}
    model = args["models"][0]
    model["skip_cfg_quality"] = quality  # on the model's own measured curve
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_synerdiff_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=default_config_path())
    parser.add_argument("--rates", type=float, nargs="+", default=[3.0, 5.0], help="req/s (default: 3 5)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals a run (default: 40)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--request-timeout", type=float, default=90.0)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=Path("results/synerdiff-live"))
    args = parser.parse_args(argv)

    from stepserve.load_tests.plots import plot_synerdiff

    base = load_serve_config(args.config)
    port = free_port()
    loads = []
    started = time.perf_counter()
    with local_ray(args.num_cpus):
        for rate in args.rates:
            workload = PoissonWorkload(rate=rate, duration_s=args.duration, steps_choices=(args.steps,), width=64,
                                       height=64, guidance_scale=5.0, prompt="a red circle on a white background")
            requests = generate(workload)
            warmup = generate(PoissonWorkload(rate=rate, num_requests=4, steps_choices=(args.steps,), width=64,
                                              height=64, guidance_scale=5.0, seed=1))
            rows = {}
            for name, variant in VARIANTS.items():
                log(f"[{rate:g} req/s] {name}: deploying, warming up, running...")
                with deployed(variant_config(base, port, *variant)) as url:
                    asyncio.run(wait_ready(url))
                    asyncio.run(run_open_loop(url, warmup, args.request_timeout, 60.0))
                    records = asyncio.run(run_open_loop(url, requests, args.request_timeout,
                                                        requests[-1].offset_s + args.request_timeout))
                s = summarize(records)
                rows[name] = {"served": s.ok, "failed": s.failed, "throughput_rps": s.throughput_rps,
                              "latency_mean_s": s.latency_mean_s, "latency_p50_s": s.latency_p50_s,
                              "latency_p99_s": s.latency_p99_s, "summary": asdict(s)}
                log(f"  {s.ok}/{s.count} ok, {s.throughput_rps:.2f} req/s, mean {s.latency_mean_s:.2f} s, "
                    f"P99 {s.latency_p99_s:.2f} s")
            naive = rows["naive (whole decodes, exact)"]
            loads.append({"base_rate": rate, "offered_rps": rate, "rows": rows,
                          "requests": len(requests)} | {
                f"{k}_vs_naive": {n: r[k] / naive[k] for n, r in rows.items()}
                for k in ("throughput_rps", "latency_mean_s", "latency_p99_s")})
    report = {"benchmark": "synerdiff_live", "setup": {**vars(args), "config": str(args.config),
                                                       "out": str(args.out), "variants": VARIANTS},
              "loads": loads, "wall_s": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "synerdiff_live.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_synerdiff(report, f"SynerDiff's served mechanisms, live: {args.config.name}, 2 workers, decode on them, "
                           f"{args.steps} steps, 64 px, {args.duration:g} s a run", args.out / "synerdiff_live.png")
    for load in loads:
        print(f"{load['base_rate']:g} req/s, {load['requests']} requests:")
        for name, row in load["rows"].items():
            print(f"  {name:30s} {row['served']} ok, {row['throughput_rps']:.2f} req/s, mean "
                  f"{row['latency_mean_s']:.2f} s, P50 {row['latency_p50_s']:.2f} s, P99 {row['latency_p99_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
