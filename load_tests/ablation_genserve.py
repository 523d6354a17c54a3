"""GenServe's ablation (genserve-slides.txt Fig. 14), simulated: the same requests on the same
8 workers under FCFS, then adding preemption, the knapsack DP and elastic SP one at a time.

    python -m stepserve.load_tests.ablation_genserve --out docs/results/genserve-ablation

Rows are `GenServeConfig` switches of the `genserve` policy (policies/genserve), then the
composed policy (policies/composed), each of which the one simulator drives through the live
`RouterCore`:

    fcfs          preemption off, greedy FCFS allocation, every video at SP degree 1
    +preemption   videos may be paused (or shrunk) at step boundaries for urgent images
    +dp           the knapsack DP over worker counts instead of greedy FCFS
    +sp           elastic SP: a video's degree changes at step boundaries (GenServe)

and two stronger baselines that give every video more than one worker, as a user of a plain
FCFS server with sequence parallelism would configure it:

    fcfs-sp2      FCFS, every video at SP degree 2
    fcfs-sp4      FCFS, every video at SP degree 4

and the composed policy (policies/composed): GenServe's spine with headroom for expected images,
CFG splits on idle workers and PatchedServe's refusal of what cannot meet its deadline (its
defaults), and the same serving every request, the late least-late first:

    composed        policy "composed", default options
    composed-late   the same with refuse_unattainable off

`--image-slo-scale` overrides the image class's SLO scale σ (the workload gives images σ = 2;
the slides' own setting is σ = 1 for everything).

Every run uses a pipeline lead of 0: a worker's next plan is decided at its step boundary,
from the state as it is then. The lead exists to hide the router's round trip, and the
simulator charges none, so a larger lead would only make GenServe decide on older state.

Each (rate, seed) runs every row on identical requests. Writes <out>/ablation.json (per row:
overall / image / video SLO attainment, mean image queue wait, the scheduler's decision time)
and <out>/ablation.png. Simulated time comes from the profile (default: the derived
genserve-rtx6000); the decision times are this machine's wall clock.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

from stepserve.load_tests.metrics import percentile
from stepserve.load_tests.plots import plot_ablation
from stepserve.load_tests.sim import SimConfig, SimResult, simulate
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.policies.composed import ComposedConfig
from stepserve.policies.genserve import GenServeConfig

ROWS: dict[str, tuple[str, GenServeConfig | ComposedConfig]] = {
    "fcfs": ("genserve", GenServeConfig(preemption=False, dp=False, elastic_sp=False, fixed_sp_degree=1)),
    "+preemption": ("genserve", GenServeConfig(preemption=True, dp=False, elastic_sp=False, fixed_sp_degree=1)),
    "+dp": ("genserve", GenServeConfig(preemption=True, dp=True, elastic_sp=False, fixed_sp_degree=1)),
    "+sp": ("genserve", GenServeConfig(preemption=True, dp=True, elastic_sp=True)),
    "fcfs-sp2": ("genserve", GenServeConfig(preemption=False, dp=False, elastic_sp=False, fixed_sp_degree=2)),
    "fcfs-sp4": ("genserve", GenServeConfig(preemption=False, dp=False, elastic_sp=False, fixed_sp_degree=4)),
    "composed": ("composed", ComposedConfig()),
    "composed-late": ("composed", ComposedConfig(refuse_unattainable=False)),
}
# Far above any backlog these rates build: the rows differ in scheduling, not in admission.
MAX_QUEUED = 1024


def row_metrics(result: SimResult) -> dict:
    def attainment(kind: str | None) -> float:
        traces = [t for t in result.traces if kind is None or t.kind == kind]
        return sum(t.met_slo for t in traces) / len(traces) if traces else float("nan")

    waits = [t.admit_s - t.submit_s for t in result.traces
             if t.kind == "image" and t.admit_s is not None and t.submit_s is not None]
    decisions_ms = [s * 1e3 for s in result.decision_wall_s]
    return {
        "slo_overall": attainment(None), "slo_image": attainment("image"), "slo_video": attainment("video"),
        "image_wait_mean_s": statistics.fmean(waits) if waits else None,
        "unfinished": sum(t.status != "finished" for t in result.traces),
        "video_pauses": sum(t.pauses for t in result.traces),
        "decision_ms_p50": percentile(decisions_ms, 50), "decision_ms_p99": percentile(decisions_ms, 99),
        "decisions": result.decisions, "end_s": result.end_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.ablation_genserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="genserve-balanced", help="workload name or YAML path")
    parser.add_argument("--profile", default="genserve-rtx6000", help="profile name or CSV path")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rates", default="0.4,0.5,0.6", help="requests per second, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="workload seeds, comma-separated")
    parser.add_argument("--round-s", type=float, default=GenServeConfig().round_s,
                        help="GenServeConfig.round_s for every row")
    parser.add_argument("--image-slo-scale", type=float, default=None,
                        help="σ of the image class (default: the workload's; the slides use 1)")
    parser.add_argument("--rows", default=",".join(ROWS), help="rows to run, comma-separated")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)

    cost = load_profile(args.profile)
    base = load_workload(args.workload)
    if args.image_slo_scale is not None:
        base = replace(base, classes=tuple(replace(c, slo_scale=args.image_slo_scale) if c.num_frames is None else c
                                           for c in base.classes))
    rows = {name: ROWS[name] for name in args.rows.split(",")}
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for rate in rates:
        for seed in seeds:
            requests = generate(replace(base.with_rate(rate), seed=seed), cost)
            for name, (policy, config) in rows.items():
                sim = SimConfig(workers=args.workers, policy=policy,
                                policy_options=asdict(replace(config, round_s=args.round_s)), pipeline_lead_s=0.0,
                                max_queued_images=MAX_QUEUED, max_queued_videos=MAX_QUEUED)
                metrics = row_metrics(simulate(requests, cost, sim))
                runs.append({"rate": rate, "seed": seed, "row": name, **metrics})
                print(f"rate {rate:g}/s seed {seed} {name:<12} overall {metrics['slo_overall']:.0%} "
                      f"image {metrics['slo_image']:.0%} video {metrics['slo_video']:.0%} "
                      f"image wait {metrics['image_wait_mean_s']:.2f}s", flush=True)

    keys = ("slo_overall", "slo_image", "slo_video", "image_wait_mean_s", "decision_ms_p50", "decision_ms_p99")
    table = {rate: {name: {k: statistics.fmean(r[k] for r in runs if r["rate"] == rate and r["row"] == name)
                           for k in keys} for name in rows} for rate in rates}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "workload": base.name, "profile": args.profile, "workers": args.workers, "rates": rates, "seeds": seeds,
        "round_s": args.round_s, "image_slo_scale": args.image_slo_scale,
        "rows": {n: {"policy": p} | c.__dict__ | {"sp_degrees": list(c.sp_degrees)} for n, (p, c) in rows.items()},
        "mean_over_seeds": {str(rate): rows for rate, rows in table.items()}, "runs": runs,
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
    }
    (out / "ablation.json").write_text(json.dumps(report, indent=2))
    plot_ablation(table, f"GenServe ablation, simulated: {base.name}, {args.workers} workers, {args.profile}",
                  out / "ablation.png")
    print(f"{'rate':>6} {'row':<12} {'overall':>8} {'image':>6} {'video':>6} {'img wait s':>10} "
          f"{'dec p50 ms':>10} {'dec p99 ms':>10}")
    for rate, by_row in table.items():
        for name, m in by_row.items():
            print(f"{rate:>6g} {name:<12} {m['slo_overall']:>8.0%} {m['slo_image']:>6.0%} {m['slo_video']:>6.0%} "
                  f"{m['image_wait_mean_s']:>10.2f} {m['decision_ms_p50']:>10.3f} {m['decision_ms_p99']:>10.3f}")
    for rate, by_row in table.items():
        if "+sp" not in by_row:
            continue
        full = by_row["+sp"]
        for name in [n for n in by_row if n.startswith("fcfs")]:
            base_slo = by_row[name]["slo_overall"]
            ratio = full["slo_overall"] / base_slo if base_slo else float("inf")
            print(f"rate {rate:g}/s: full/{name} overall SLO {ratio:.2f}x (full image SLO {full['slo_image']:.0%})")
    print(f"wrote {out / 'ablation.json'} and {out / 'ablation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
