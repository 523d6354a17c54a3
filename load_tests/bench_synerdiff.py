"""SynerDiff simulated at GPU magnitude (synerdiff.txt §IV): the burst workload on one GPU with
images decoded on it, continuous batching with the full SynerDiff stack against naive continuous
batching (InstGenIE's direct UNet-VAE concurrency: whole decodes beside the rounds), with one
ablation row per component (`load_tests.sim.synerdiff`: VAE chunking, skip-CFG, the sequence
planner, the feedback controller) and the simulator's serial decode (after the plan) for reference.

Step and decode times come from the profile (`--profile`, default SD1.5 on an A100); how a
round's step and decodes slow each other is the concurrent-latency model derived from the paper
(`policies.synerdiff.contention`, labelled as derived: no GPU here measured it); skip-CFG's
quality is the shapes model's measured curve. `--rates` are the workload's base rates (the burst
keeps its ratio to the base).

    python -m stepserve.load_tests.bench_synerdiff --out docs/results/synerdiff-sim

Writes synerdiff.json and synerdiff.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from stepserve.load_tests.sim.simulator import SimConfig, simulate
from stepserve.load_tests.sim.synerdiff import SynerDiffSim
from stepserve.load_tests.sweep import load_cost, parse_rates
from stepserve.load_tests.workload import generate, load_workload

RULE_THROUGHPUT, RULE_P99 = 1.6, 0.5  # the bar (paper: 1.6x, -78.7%)
NAIVE = SynerDiffSim(chunking=False, skip_cfg=False, planner=False, controller=False)
FULL = SynerDiffSim()
VARIANTS: dict[str, SynerDiffSim | None] = {
    "serial decode": None,
    "naive continuous batching": NAIVE,
    "SynerDiff": FULL,
    "- chunking": dataclasses.replace(FULL, chunking=False),
    "- skip-CFG": dataclasses.replace(FULL, skip_cfg=False),
    "- planner": dataclasses.replace(FULL, planner=False),
    "- controller": dataclasses.replace(FULL, controller=False),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_synerdiff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="synerdiff-burst")
    parser.add_argument("--profile", default="sd15-a100")
    parser.add_argument("--rates", type=parse_rates, default=[0.3, 2.0],
                        help="base arrival rates, req/s (default: 0.3,2.0: the burst alone overloads both; then "
                             "beyond naive's capacity all along)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per run (default: %(default)s)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="SynerDiff's BS=8 (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("results/synerdiff-sim"))
    args = parser.parse_args(argv)

    from stepserve.load_tests.plots import plot_synerdiff

    started = time.perf_counter()
    cost = load_cost(args.profile)
    spec = dataclasses.replace(load_workload(args.workload), num_requests=args.requests)
    base = SimConfig(workers=1, max_batch_size=args.max_batch_size, decoders=0)
    loads = []
    for rate in args.rates:
        requests = generate(spec.with_rate(rate), cost)
        rows = {}
        for name, synerdiff in VARIANTS.items():
            result = simulate(requests, cost, dataclasses.replace(base, synerdiff=synerdiff))
            s = result.summary()
            rows[name] = {"served": s.ok, "rejected_or_failed": s.failed, "throughput_rps": s.throughput_rps,
                          "latency_mean_s": s.latency_mean_s, "latency_p99_s": s.latency_p99_s,
                          "queue_wait_mean_s": s.queue_wait_mean_s,
                          "decode_mean_s": result.stage_means("image")["decode"],
                          "sim_wall_s": round(result.wall_s, 2)}
            print(f"base rate {rate:g}: {name}: {s.ok} served, {s.throughput_rps:.3f} req/s, mean "
                  f"{s.latency_mean_s:.1f} s, P99 {s.latency_p99_s:.1f} s", file=sys.stderr)
        naive = rows["naive continuous batching"]
        full = rows["SynerDiff"]
        loads.append({"base_rate": rate, "offered_rps": spec.with_rate(rate).mean_rate, "rows": rows,
                      "throughput_vs_naive": full["throughput_rps"] / naive["throughput_rps"],
                      "p99_vs_naive": full["latency_p99_s"] / naive["latency_p99_s"],
                      "mean_vs_naive": full["latency_mean_s"] / naive["latency_mean_s"]})
    report = {"benchmark": "synerdiff_sim",
              "setup": {"workload": args.workload, "requests": args.requests, "profile": args.profile,
                        "workers": 1, "max_batch_size": args.max_batch_size,
                        "variants": {k: None if v is None else v.describe() for k, v in VARIANTS.items()},
                        "contention": "derived (policies/synerdiff/contention.py), not measured"},
              "rule": {"throughput_at_least": RULE_THROUGHPUT, "p99_at_most": RULE_P99},
              "loads": loads, "wall_s": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "synerdiff.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_synerdiff(report, f"SynerDiff simulated: {args.workload} ({args.requests} requests), {args.profile}, one GPU, "
                           "decode on it; contention derived", args.out / "synerdiff.png")
    for load in loads:
        print(f"base rate {load['base_rate']:g} req/s: SynerDiff {load['throughput_vs_naive']:.2f}x the throughput "
              f"of naive continuous batching, P99 {load['p99_vs_naive']:.2f}x, mean {load['mean_vs_naive']:.2f}x")
        for name, row in load["rows"].items():
            print(f"  {name:28s} {row['throughput_rps']:.3f} req/s  mean {row['latency_mean_s']:7.1f} s  "
                  f"P99 {row['latency_p99_s']:7.1f} s  served {row['served']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
