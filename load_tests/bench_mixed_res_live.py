"""Mixed resolutions, live: PatchedServe's comparison (§8) at small scale on this machine's tiny
models, the live counterpart of `bench_mixed_res_sim`.

One model (default: the first of configs/local-tiny.yaml, tiny-sd) gets an equal mix of three sizes
(default 64, 96 and 128 px), a fixed step count with CFG, Poisson arrivals. Each size's solo
latency is measured first, live (sequential requests on the idle, warmed app, the median of a
few), and each request carries its own `slo_s` = `--slo-scale` (5, as the paper) x its size's
solo latency. Then for each variant the app is deployed with only `router.policy`,
`router.policy_options` and `workers.pack_resolutions` changed, warmed up, driven open-loop at
each rate with the same requests (same seed; a rate only moves them closer together), and
deleted:

- `static_fcfs`: request-level static batching;
- `continuous`: step-level continuous batching, one forward per resolution a step;
- `continuous_packed`: the same on workers that run a step's resolutions as one forward
  (`engine/step_runner.py`, PatchedServe's "Mixed-Cache" baseline);
- `patchedserve`: Algorithm 1 (`policies/patchedserve`), one forward per resolution;
- `patchedserve_packed`: Algorithm 1 (`policies/patchedserve`) on packing workers (the router
  prices its rounds as packed forwards when the workers pack).

Every variant is priced by the same latency profile (`--profile`, default tiny-sd-cpu, measured
on this machine); only `patchedserve` schedules by it. A request refused with 429
(`deadline_unattainable`: PatchedServe gave it up) or without an answer counts as an SLO miss.
Goodput at 90% SLO attainment is `bench_mixed_res_sim.goodput_at`'s.

    python -m stepserve.load_tests.bench_mixed_res_live --out results/mixed-res-live

Writes mixed_res_live.json and mixed_res_live.png (SLO attainment against rate, goodput bars).
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stepserve.load_tests.bench_mixed_res_sim import SLO_SCALE, TARGET, goodput_at
from stepserve.load_tests.live import one_by_one, run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.sweep import format_summary, parse_rates
from stepserve.load_tests.workload import PoissonArrivals, RequestClass, ScheduledRequest, SizeChoice, StepsChoice
from stepserve.load_tests.workload import WorkloadSpec, generate
from stepserve.runtime import tiny_config_path, load_serve_config


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    pack_resolutions: bool  # workers run a step's resolutions as one forward


VARIANTS = (
    Variant("static_fcfs", "static_fcfs", False),
    Variant("continuous", "continuous", False),
    Variant("continuous_packed", "continuous", True),
    Variant("patchedserve", "patchedserve", False),
    Variant("patchedserve_packed", "patchedserve", True),
)
ANALYZED = ("patchedserve",)  # policies whose options take the sizes their throughput analyzer trains on


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_mixed_res_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for mixed_res_live.json and .png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(),
                        help="Serve config to deploy (default: %(default)s)")
    parser.add_argument("--model", default=None, help="served model to load (default: the config's first)")
    parser.add_argument("--profile", default="tiny-sd-cpu",
                        help="latency profile covering the model (configs/profiles name or CSV; default: %(default)s)")
    parser.add_argument("--variants", default=",".join(v.label for v in VARIANTS),
                        help="comma-separated, in run order (default: %(default)s)")
    parser.add_argument("--sizes", default="64,96,128", help="square sides in px, drawn equally (default: %(default)s)")
    # On the 2-core development VM tiny-sd's solo latencies for the default mix are 0.29, 0.37 and
    # 0.54 s, and continuous batching held 2 req/s at 81-100% in 10 s smoke runs (the box shared):
    # 1-5 req/s runs from well under to past what the baselines hold at 90%.
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,3,4,5"),
                        help="offered req/s, comma-separated (default: 1,2,3,4,5)")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of arrivals a rate (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20,
                        help="num_inference_steps of every request (default: %(default)s)")
    parser.add_argument("--guidance", type=float, default=7.5, help="guidance_scale (default: %(default)s)")
    parser.add_argument("--slo-scale", type=float, default=SLO_SCALE,
                        help="SLO = this x the size's solo latency (default: %(default)s)")
    parser.add_argument("--solo-repeats", type=int, default=5,
                        help="solo requests a size, median taken (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="requests before each variant's runs (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=20.0,
                        help="seconds a request may take before it counts as failed (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(),
                        help="CPUs the local Ray may schedule (default: %(default)s)")
    args = parser.parse_args(argv)
    known = {v.label: v for v in VARIANTS}
    labels = [label for label in args.variants.split(",") if label]
    unknown = [label for label in labels if label not in known]
    if unknown or not labels:
        parser.error(f"unknown variant(s) {unknown}; known: {list(known)}")
    args.variants = [known[label] for label in labels]
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes takes comma-separated ints, got {args.sizes!r}")
    if not args.sizes or len(set(args.sizes)) != len(args.sizes):
        parser.error(f"--sizes needs distinct sides, got {args.sizes}")
    return args


# -- the requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredSolo:
    """Solo latencies measured live, by side: the `SoloCost` that `workload.generate` prices
    each request's SLO with (one model, one step count and CFG mode a run)."""

    seconds: Mapping[int, float]

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        return self.seconds[width]


def mix_spec(model: str, sizes: Sequence[int], steps: int, guidance: float, rate: float, seed: int,
             slo_scale: float | None = None, duration_s: float | None = None,
             num_requests: int | None = None) -> WorkloadSpec:
    """`sizes` in equal shares at Poisson `rate`; ends after `duration_s` or `num_requests`."""
    mix = RequestClass("mixed", model, tuple(SizeChoice(s, s) for s in sizes), StepsChoice(choices=(steps,)),
                       guidance_scale=guidance, unique_prompts=True)
    return WorkloadSpec(PoissonArrivals(rate), (mix,), duration_s=duration_s, num_requests=num_requests,
                        slo_scale=slo_scale, seed=seed, name="mixed-res-live",
                        description="sizes in equal shares, Poisson, SLO a multiple of solo")


def slo_requests(spec: WorkloadSpec, solo: MeasuredSolo) -> list[ScheduledRequest]:
    """The run's requests, each carrying `slo_s` = the spec's scale x its size's solo latency."""
    return [replace(r, send_slo=True) for r in generate(spec, solo)]


# -- the live part ---------------------------------------------------------------------------


def variant_config(base: dict[str, Any], port: int, variant: Variant, profile: str,
                   sizes: Sequence[int]) -> dict[str, Any]:
    """The base config with the variant's policy and packing (and PatchedServe's analyzer trained
    on the run's sizes); every variant gets the same profile, so they differ only in what the
    variant names."""
    config = bench_serve_config(base, port, variant.policy)
    args = config["applications"][0]["args"]
    args["workers"] = {**(args.get("workers") or {}), "pack_resolutions": variant.pack_resolutions}
    options = {"sizes": [[s, s] for s in sizes]} if variant.policy in ANALYZED else {}
    args["router"].update(profiles=[profile], policy_options=options)
    return config


def measure_solo(url: str, model: str, sizes: Sequence[int], steps: int, guidance: float, repeats: int,
                 seed: int, timeout_s: float) -> dict[int, float]:
    """Median end-to-end latency of a request alone on the idle app, by side."""
    solo = {}
    for size in sizes:
        requests = generate(mix_spec(model, [size], steps, guidance, 1.0, seed, num_requests=repeats))
        solo[size] = statistics.median(r.latency_s for r in one_by_one(url, requests, timeout_s))
    return solo


def run_variant(base: dict[str, Any], port: int, variant: Variant, args: argparse.Namespace, model: str,
                solo: dict[int, float] | None) -> tuple[dict[int, float], dict[float, list[RequestRecord]]]:
    """Deploy the variant, warm it up, measure solo latencies when none are known yet, and run
    every rate; returns the solo latencies and each rate's records."""
    config = variant_config(base, port, variant, args.profile, args.sizes)
    with deployed(config) as url:
        asyncio.run(wait_ready(url))
        if args.warmup:
            # Same mix, another seed: every size's code path runs before the measured requests.
            warmup = generate(mix_spec(model, args.sizes, args.steps, args.guidance, min(args.rates), args.seed + 1,
                                       num_requests=args.warmup))
            warm = asyncio.run(run_open_loop(url, warmup, args.request_timeout,
                                             warmup[-1].offset_s + args.request_timeout))
            failed = [r for r in warm if not r.ok]
            if failed:
                raise RuntimeError(f"{variant.label}: warm-up failed ({len(failed)} of {len(warm)}): {failed[0].error}")
        if solo is None:
            solo = measure_solo(url, model, args.sizes, args.steps, args.guidance, args.solo_repeats, args.seed + 2,
                                args.request_timeout)
            log("solo latency: " + ", ".join(f"{s} px {1e3 * t:.0f} ms" for s, t in solo.items()))
        records = {}
        for rate in args.rates:
            spec = mix_spec(model, args.sizes, args.steps, args.guidance, rate, args.seed, args.slo_scale,
                            duration_s=args.duration)
            requests = slo_requests(spec, MeasuredSolo(solo))
            records[rate] = asyncio.run(run_open_loop(url, requests, args.request_timeout,
                                                      requests[-1].offset_s + args.request_timeout))
            log(f"[{variant.label} @ {rate:g} req/s] {format_summary(summarize(records[rate], offered_rps=rate))}")
    return solo, records


# -- results ---------------------------------------------------------------------------------


def sweep_of(records: Mapping[float, Sequence[RequestRecord]]) -> list[tuple[float, Summary]]:
    return [(rate, summarize(recs, offered_rps=rate)) for rate, recs in sorted(records.items())]


def by_size(records: Sequence[RequestRecord]) -> dict[str, Summary]:
    """Per side: whether one size pays for the others."""
    return {str(w): summarize([r for r in records if r.width == w]) for w in sorted({r.width for r in records})}


def goodputs(sweeps: Mapping[str, Sequence[tuple[float, Summary]]]) -> dict[str, dict[str, Any]]:
    """Each variant's goodput at `TARGET` attainment, and its ratio to static batching's."""
    out = {label: goodput_at([(rate, s.slo_attainment or 0.0) for rate, s in points])
           for label, points in sweeps.items()}
    static = out.get("static_fcfs", {}).get("rps")
    for entry in out.values():
        entry["vs_static"] = None if not static or entry["rps"] is None else entry["rps"] / static
    return out


def build_report(setup: dict[str, Any], solo: Mapping[int, float],
                 records: Mapping[str, Mapping[float, Sequence[RequestRecord]]]) -> dict[str, Any]:
    """The JSON of a run: `setup` as given, the solo latencies and SLOs, goodput, and per variant
    and rate the summary, the summary by size and every record."""
    sweeps = {label: sweep_of(recs) for label, recs in records.items()}
    scale = setup["slo_scale"]
    return {
        **setup,
        "solo_s": {str(s): t for s, t in solo.items()},
        "slo_s": {str(s): scale * t for s, t in solo.items()},
        "target_attainment": TARGET,
        "goodput_at_90": goodputs(sweeps),
        "runs": [{"variant": label, "rate": rate, "summary": asdict(summary),
                  "by_size": {s: asdict(v) for s, v in by_size(records[label][rate]).items()},
                  "records": [asdict(r) for r in records[label][rate]]}
                 for label, points in sweeps.items() for rate, summary in points],
    }


def plot_mixed_res(sweeps: Mapping[str, Sequence[tuple[float, Summary]]], goodput: Mapping[str, Mapping[str, Any]],
                   title: str, path: Path) -> None:
    """SLO attainment against offered load, one line a variant; goodput at 90% as bars (hatched:
    a lower bound, every rate met it)."""
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    slo, good = figure.subplots(1, 2, width_ratios=(1.6, 1))
    figure.suptitle(title)
    for i, (label, points) in enumerate(sweeps.items()):
        slo.plot([r for r, _ in points], [100 * (s.slo_attainment or 0.0) for _, s in points], "o-",
                 color=f"C{i}", label=label)
        entry = goodput[label]
        bar = good.bar(i, entry["rps"] or 0.0, color=f"C{i}", hatch="//" if entry["at_least"] else None)
        good.bar_label(bar, labels=["none" if entry["rps"] is None else
                                    f"{'>=' if entry['at_least'] else ''}{entry['rps']:.2f}"], fontsize=8)
    slo.axhline(100 * TARGET, color="grey", linestyle=":", linewidth=0.8)
    slo.set(xlabel="offered load (req/s)", ylabel="requests meeting their SLO (%)", title="SLO attainment",
            ylim=(0, 102))
    slo.grid(alpha=0.3)
    slo.legend(fontsize=8)
    good.set_xticks(range(len(sweeps)), list(sweeps), rotation=20, fontsize=8)
    good.set(ylabel="req/s", title=f"goodput at {100 * TARGET:.0f}% SLO attainment")
    good.grid(alpha=0.3, axis="y")
    figure.savefig(path, dpi=110)


def write_outputs(out: Path, report: dict[str, Any], title: str) -> tuple[Path, Path]:
    """mixed_res_live.json and mixed_res_live.png in `out`, from a `build_report` report."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "mixed_res_live.json", out / "mixed_res_live.png"
    json_path.write_text(json.dumps(report, indent=1))
    sweeps: dict[str, list[tuple[float, Summary]]] = {}
    for run in report["runs"]:
        sweeps.setdefault(run["variant"], []).append((run["rate"], Summary(**run["summary"])))
    plot_mixed_res(sweeps, report["goodput_at_90"], title, png_path)
    return json_path, png_path


def print_table(report: dict[str, Any]) -> None:
    rates = sorted({run["rate"] for run in report["runs"]})
    print(f"SLO attainment by rate {', '.join(f'{r:g}' for r in rates)} req/s; SLO "
          + ", ".join(f"{s} px {t:.2f} s" for s, t in report["slo_s"].items()))
    for label, good in report["goodput_at_90"].items():
        cells = [f"{100 * (run['summary']['slo_attainment'] or 0.0):5.1f}%" for run in report["runs"]
                 if run["variant"] == label]
        value = "-" if good["rps"] is None else f"{'>= ' if good['at_least'] else ''}{good['rps']:.2f}"
        ratio = "" if good["vs_static"] is None else f" ({good['vs_static']:.2f}x static)"
        print(f"  {label:<20} {' '.join(cells)}   goodput@90%: {value} req/s{ratio}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = load_serve_config(args.config)
    models = base["applications"][0]["args"]["models"]
    model = args.model or models[0]["name"]
    started = time.perf_counter()
    solo: dict[int, float] | None = None
    records: dict[str, dict[float, list[RequestRecord]]] = {}
    port = free_port()  # one for all apps: Serve keeps the HTTP options it first started with
    with local_ray(args.num_cpus):
        for variant in args.variants:
            log(f"[{variant.label}] deploying, warming up, running {len(args.rates)} rate(s)...")
            solo, records[variant.label] = run_variant(base, port, variant, args, model, solo)
    setup = {
        "benchmark": "mixed_res_live", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "ray_num_cpus": args.num_cpus},
        "config_path": str(args.config), "model": model, "profile": args.profile, "sizes": args.sizes,
        "steps": args.steps, "guidance_scale": args.guidance, "slo_scale": args.slo_scale, "rates": args.rates,
        "duration_s": args.duration, "seed": args.seed, "request_timeout_s": args.request_timeout,
        "solo_measured_on": args.variants[0].label, "variants": [asdict(v) for v in args.variants],
    }
    report = build_report(setup, solo, records)
    report["wall_s"] = time.perf_counter() - started
    title = (f"{model}, {'/'.join(map(str, args.sizes))} px, {args.steps} steps, Poisson {args.duration:g} s a rate, "
             f"SLO {args.slo_scale:g}x solo")
    json_path, png_path = write_outputs(args.out, report, title)
    print_table(report)
    print(f"wrote {json_path} and {png_path} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
