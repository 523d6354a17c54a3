"""Mixed resolutions at GPU magnitude, simulated: PatchedServe's SLO-aware scheduler (§6,
`policies/patchedserve`) against request-level static batching and step-level continuous
batching.

The workload is PatchedServe §8's: 512, 768 and 1024 px in equal shares, 50 steps with CFG,
Poisson arrivals, SLO = 5 x each request's solo latency, on 8 workers batching at most 12
requests (§8). Two models, each on its shipped GPU-magnitude profile, both DERIVED from
published figures, not measured (configs/profiles/README.md): SDXL on `sdxl-h800`
(stable-diffusion-xl-base-1.0) and SD3 on `genserve-rtx6000` (sd3.5-medium).

Rows, each on the same requests at every rate:

- `static_fcfs`: request-level static batching (one shape and step count a batch, run to the end);
- `continuous`: step-level continuous batching on today's workers (one forward per resolution
  group a step, so a 512 px request steps at the pace of its worker's sum);
- `continuous, packed`: the same policy on workers that run a step's resolutions as one forward
  (PatchedServe's "Mixed-Cache" baseline: FCFS with patched batching);
- `patchedserve`: Algorithm 1 on today's workers;
- `patchedserve, packed`: Algorithm 1 on packing workers (it prices with the packed cost model).

Packing workers are simulated by pricing their rounds with `PackedForwardCosts`
(policies/patchedserve/mixed_costs.py): the engine cannot run such a forward yet, so those rows
rest on that model, not on a measurement. The JSON shows what it gives for a few batches.

Goodput at 90% SLO attainment (as PatchedServe §8.1 reports it, after DistServe): the highest
offered rate at which at least 90% of the requests meet their SLO, linear between the last rate
that does and the first that does not; a lower bound (`at_least`) when every rate does, None
when none does. Discarded requests count as misses.

    python -m stepserve.load_tests.bench_mixed_res_sim --out docs/results/mixed-res-sim

Writes mixed_res.json and mixed_res_<model>.png (SLO attainment, goodput and P95 against load).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.plots import plot_load_sweep
from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.sweep import format_summary, parse_rates
from stepserve.load_tests.workload import PoissonArrivals, RequestClass, SizeChoice, StepsChoice, WorkloadSpec, generate
from stepserve.policies.cost_model import BatchShape, CostModel, load_profile
from stepserve.policies.patchedserve import PackedForwardCosts, PatchedServeConfig, holdout_error, training_samples

MODELS = {  # name -> (shipped profile, model)
    "sdxl": ("sdxl-h800", "stable-diffusion-xl-base-1.0"),
    "sd3": ("genserve-rtx6000", "sd3.5-medium"),
}
SIZES = (512, 768, 1024)
STEPS = 50  # §8: 50 steps for both models
SLO_SCALE = 5.0  # §8: 5x the solo latency (Clockwork's convention)
TARGET = 0.9  # §8.1: goodput while at least 90% meet their SLO
ROWS = (  # label, policy, options, workers pack resolutions into one forward
    ("static_fcfs", "static_fcfs", {}, False),
    ("continuous", "continuous", {}, False),
    ("continuous, packed", "continuous", {}, True),
    ("patchedserve", "patchedserve", {}, False),
    ("patchedserve, packed", "patchedserve", {}, True),
    ("composed", "composed", {}, False),
    ("composed, packed", "composed", {"pack_resolutions": True}, True),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_mixed_res_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG files")
    parser.add_argument("--models", default="sdxl,sd3", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--sdxl-rates", type=parse_rates, default=parse_rates("3,4,5,6,7,8"),
                        help="offered req/s for SDXL (default: %(default)s)")
    parser.add_argument("--sd3-rates", type=parse_rates, default=parse_rates("1.5,2,2.5,3,3.5,4"),
                        help="offered req/s for SD3 (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=1000, help="requests a run")
    parser.add_argument("--workers", type=int, default=8, help="§8.2: 8 GPUs, one worker each")
    parser.add_argument("--max-batch-size", type=int, default=12, help="§8: 12 requests at most a batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    return args


def workload(model: str, rate: float, requests: int, seed: int) -> WorkloadSpec:
    mix = RequestClass("mixed", model, tuple(SizeChoice(s, s) for s in SIZES), StepsChoice(choices=(STEPS,)),
                       guidance_scale=7.5, unique_prompts=True)
    return WorkloadSpec(PoissonArrivals(rate), (mix,), num_requests=requests, slo_scale=SLO_SCALE, seed=seed,
                        name="patchedserve-mixed", description="512/768/1024 px equally, 50 steps, Poisson, SLO 5x")


def sim_config(args: argparse.Namespace, policy: str, options: dict[str, Any]) -> SimConfig:
    # A GPU cluster: a VAE decoder per worker, a text encoder per four, queues that never reject
    # (PatchedServe drops only what cannot meet its deadline).
    return SimConfig(workers=args.workers, max_batch_size=args.max_batch_size, policy=policy, policy_options=options,
                     decoders=args.workers, text_encoder=TextEncoderSpec(replicas=max(1, args.workers // 4)),
                     max_queued_images=1_000_000)


def goodput_at(points: list[tuple[float, float]], target: float = TARGET) -> dict[str, Any]:
    """The highest rate with attainment >= target, from (rate, attainment) points (see the
    module docstring)."""
    points = sorted(points)
    if not points or points[0][1] < target:
        return {"rps": None, "at_least": False}
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        if a1 < target:
            return {"rps": r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "at_least": False}
    return {"rps": points[-1][0], "at_least": True}


def packing_examples(base: CostModel, model: str) -> list[dict[str, Any]]:
    """One step of a few batches (CFG requests) with one forward per resolution and packed."""
    packed = PackedForwardCosts(base)
    out = []
    for each in (1, 2, 4):
        shapes = [BatchShape(model, s, s, 2 * each) for s in SIZES]
        out.append({"requests_per_size": each, "separate_ms": 1e3 * base.round_seconds(shapes),
                    "packed_ms": 1e3 * packed.round_seconds(shapes)})
    return out


def analyzer_errors(base: CostModel, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The Throughput Analyzer's held-out error (§6.1: 200 combinations, 80/20) on each pricing.
    Nothing here is measured: the profiles are derived, and the simulated device runs at what the
    cost model says, so the cost model's prices stand for measured ones (labelled so in the JSON)."""
    config = PatchedServeConfig(max_batch_size=args.max_batch_size)
    sizes = tuple((s, s) for s in SIZES)
    out = {}
    for label, pricing in (("separate", base), ("packed", PackedForwardCosts(base))):
        samples = training_samples(pricing, model, sizes, config.training_batch, config.training_samples, config.seed)
        _, report = holdout_error([replace(s, measured=True) for s in samples], config.seed)
        out[label] = asdict(report)
    return out


def run_model(args: argparse.Namespace, name: str, rates: list[float]) -> dict[str, Any]:
    profile, model = MODELS[name]
    base = load_profile(profile)
    packed = PackedForwardCosts(base)
    runs: list[dict[str, Any]] = []
    sweeps: dict[str, list[tuple[float, Summary]]] = {label: [] for label, *_ in ROWS}
    for rate in rates:
        requests = generate(workload(model, rate, args.requests, args.seed), base)
        for label, policy, options, packs in ROWS:
            result = simulate(requests, packed if packs else base, sim_config(args, policy, options))
            summary = summarize(result.records(), result.busy_s, rate)
            sweeps[label].append((rate, summary))
            print(f"[{name} {label} @ {rate:g} req/s] {format_summary(summary)} ({result.wall_s:.1f} s wall)",
                  file=sys.stderr, flush=True)
            runs.append({"policy": label, "rate": rate, "summary": asdict(summary),
                         "discarded": sum(1 for t in result.traces if t.status == "failed"),
                         "decision_ms_mean": 1e3 * result.plan_wall_s / max(1, result.decisions),
                         "wall_s": result.wall_s})
    goodput = {label: goodput_at([(r, s.slo_attainment or 0.0) for r, s in points]) for label, points in sweeps.items()}
    static = goodput["static_fcfs"]["rps"]
    for entry in goodput.values():  # the measure: against request-level static batching
        entry["vs_static"] = None if static is None or entry["rps"] is None else entry["rps"] / static
    title = (f"{model} ({profile}, derived), {args.workers} workers, batch cap {args.max_batch_size}, "
             f"512/768/1024 px, SLO {SLO_SCALE:g}x solo")
    plot_load_sweep(sweeps, title, args.out / f"mixed_res_{name}.png")
    return {
        "profile": profile, "model": model, "rates": rates,
        "solo_s": {str(s): base.solo_seconds(model, s, s, STEPS, True) for s in SIZES},
        "packing_examples": packing_examples(base, model),
        "analyzer_holdout": analyzer_errors(base, model, args),
        "analyzer_holdout_scored_against": "the cost model (a derived profile: the simulated device)",
        "goodput_at_90": goodput, "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rates = {"sdxl": args.sdxl_rates, "sd3": args.sd3_rates}
    report: dict[str, Any] = {
        "benchmark": "mixed_res_sim", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workers": args.workers, "max_batch_size": args.max_batch_size, "requests": args.requests, "seed": args.seed,
        "slo_scale": SLO_SCALE, "steps": STEPS, "sizes": SIZES, "target_attainment": TARGET,
        "models": {name: run_model(args, name, rates[name]) for name in args.models.split(",")},
    }
    report["wall_s"] = time.perf_counter() - started
    (args.out / "mixed_res.json").write_text(json.dumps(report, indent=1))
    for name, entry in report["models"].items():
        print(f"{name} ({entry['profile']}): SLO attainment by rate " + ", ".join(f"{r:g}" for r in entry["rates"]))
        for label, *_ in ROWS:
            cells = [f"{100 * run['summary']['slo_attainment']:5.1f}%" for run in entry["runs"]
                     if run["policy"] == label]
            good = entry["goodput_at_90"][label]
            value = "-" if good["rps"] is None else f"{'>= ' if good['at_least'] else ''}{good['rps']:.2f}"
            ratio = "" if good["vs_static"] is None else f" ({good['vs_static']:.2f}x static)"
            print(f"  {label:<22} {' '.join(cells)}   goodput@90%: {value} req/s{ratio}")
        errors = entry["analyzer_holdout"]
        print("  analyzer held-out error (mean / max): " + ", ".join(
            f"{k} {v['mean_rel_err']:.1%} / {v['max_rel_err']:.1%}" for k, v in errors.items()))
    print(f"wrote {args.out / 'mixed_res.json'} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
