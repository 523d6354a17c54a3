"""Simulated load sweeps: policies × offered rates on one workload and cost profile, written as
JSON + PNG. Shared by `python -m stepserve.load_tests.sim` and `compare_policies`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.plots import plot_latency_cdfs, plot_load_sweep, plot_policy_bars
from stepserve.load_tests.sim import SimConfig, SimResult, TextEncoderSpec, simulate
from stepserve.load_tests.workload import WorkloadSpec, describe, generate, load_workload


@dataclass(frozen=True)
class SweepRun:
    policy: str
    rate: float
    result: SimResult
    summary: Summary


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text!r}")
    return rates


def add_sim_args(parser: argparse.ArgumentParser) -> None:
    """Flags every simulated run takes (the workload, the cost profile, the cluster)."""
    parser.add_argument("--workload", required=True,
                        help="workload YAML, or the name of one in load_tests/workloads/ (e.g. synerdiff-mixed)")
    parser.add_argument("--profile", required=True,
                        help="cost profile: a CSV path or a shipped name (e.g. sd15-a100, tiny-sd-cpu)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG files")
    parser.add_argument("--rates", type=parse_rates, default=None,
                        help="offered mean rates, req/s, comma-separated (default: the workload's own rate)")
    parser.add_argument("--workers", type=int, default=None, help="denoiser workers (default: 8)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="requests resident per worker (default: 8, SynerDiff's cap)")
    parser.add_argument("--pipeline-depth", type=int, default=None, help="plans in flight per worker (default: 2)")
    parser.add_argument("--pipeline-lead", type=float, default=None,
                        help="seconds before a busy worker's current plan is predicted to end that its next one is "
                             "decided, as the router does (default: 0.05; 0: at the step boundary; inf: whenever a "
                             "round finds room in its pipeline)")
    parser.add_argument("--max-queued-images", type=int, default=None,
                        help="image requests waiting or decoding beyond which new ones are rejected, as the router "
                             "does (default: 256)")
    parser.add_argument("--max-queued-videos", type=int, default=None,
                        help="the same bound for videos (default: 1024)")
    parser.add_argument("--decoders", type=int, default=None,
                        help="VAE decoder replicas (default: one per worker; 0: images decode on their worker)")
    parser.add_argument("--text-encoders", type=int, default=None,
                        help="text encoder replicas (default: 1; 0: each worker encodes the prompts it admits)")
    parser.add_argument("--host-cpus", type=float, default=None,
                        help="all components share one CPU host of this many cores (a CPU box running the whole "
                             "app, as configs/local-tiny.yaml does); default: each has a device of its own")
    parser.add_argument("--serve-config", type=Path, default=None,
                        help="take workers, batch cap, policy, queue bounds, pipeline depth and lead, encoder and "
                             "decoder replicas from this Serve YAML (flags given explicitly still win)")
    parser.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")
    parser.add_argument("--duration", type=float, default=None, help="override the workload's duration, s")
    parser.add_argument("--seed", type=int, default=None, help="override the workload's seed")
    parser.add_argument("--traces", action="store_true", help="also write every request's simulated timeline")


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    spec = load_workload(args.workload)
    if args.num_requests is not None or args.duration is not None:
        spec = replace(spec, num_requests=args.num_requests, duration_s=args.duration)
    if args.seed is not None:
        spec = replace(spec, seed=args.seed)
    return spec


def sim_config_from_serve(path: str | os.PathLike) -> dict[str, Any]:
    """SimConfig fields from a Serve YAML's app args, with the app config's defaults filled in."""
    from stepserve.deployments.config import AppConfig  # heavy (ray, torch): only when asked
    from stepserve.runtime import load_serve_config

    from stepserve.engine.families import family_class
    from stepserve.engine.forward_modes.base import ModeName

    app = AppConfig.model_validate(load_serve_config(path)["applications"][0].get("args", {}))
    te = app.text_encoder
    packing = tuple(m.name for m in app.models if ModeName.PACKED in family_class(m.family).forward_modes)
    return dict(
        packing=packing if app.workers.pack_resolutions else (),
        workers=app.workers.num_workers, max_batch_size=app.workers.max_batch_size, policy=app.router.policy,
        policy_options=dict(app.router.policy_options), max_queued_images=app.router.max_queued_images,
        max_queued_videos=app.router.max_queued_videos, pipeline_depth=app.router.pipeline_depth,
        pipeline_lead_s=app.router.pipeline_lead_s, max_plan_s=app.router.max_plan_s,
        lora_batches=app.lora_loading.batches, lora_resident=app.lora_loading.max_resident,
        decoders=0 if app.vae_decoder.on_workers else app.vae_decoder.num_replicas,
        text_encoder=TextEncoderSpec(replicas=0 if te.on_workers else te.num_replicas,
                                     max_batch_size=te.max_batch_size, batch_wait_s=te.batch_wait_timeout_s,
                                     cache_size=te.cache_size),
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    fields: dict[str, Any] = {"workers": 8, "max_batch_size": 8}
    if args.serve_config is not None:
        fields.update(sim_config_from_serve(args.serve_config))
    explicit = dict(workers=args.workers, max_batch_size=args.max_batch_size, pipeline_depth=args.pipeline_depth,
                    pipeline_lead_s=args.pipeline_lead, max_queued_images=args.max_queued_images,
                    max_queued_videos=args.max_queued_videos, decoders=args.decoders, host_cpus=args.host_cpus)
    fields.update({k: v for k, v in explicit.items() if v is not None})
    if args.text_encoders is not None:
        fields["text_encoder"] = replace(fields.get("text_encoder", TextEncoderSpec()), replicas=args.text_encoders)
    if "decoders" not in fields:
        # One decoder per worker: each GPU decodes what it denoised (SynerDiff, InstGenIE).
        fields["decoders"] = fields["workers"]
    return SimConfig(**fields)


def load_cost(profile: str) -> Any:
    """One profile's cost model, or several's (comma-separated names or paths: one per model)."""
    from stepserve.policies.cost_model import load_profile

    return load_profile(*profile.split(","))


def run_sweep(spec: WorkloadSpec, cost: Any, config: SimConfig, policies: Sequence[str],
              rates: Sequence[float], policy_options: Mapping[str, Mapping[str, Any]] | None = None,
              log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> list[SweepRun]:
    """Every policy at every rate, each on the same requests (same seed, rescaled in time)."""
    runs: list[SweepRun] = []
    for rate in rates:
        requests = generate(spec.with_rate(rate), cost)
        for policy in policies:
            options = (policy_options or {}).get(policy)
            if options is None and policy == config.policy:
                options = config.policy_options
            run_config = replace(config, policy=policy, policy_options=dict(options or {}))
            result = simulate(requests, cost, run_config)
            summary = summarize(result.records(), result.busy_s, rate)
            log(f"[{policy} @ {rate:g} req/s] {len(requests)} requests, simulated {result.end_s:.0f} s "
                f"in {result.wall_s:.1f} s wall: {format_summary(summary)}")
            runs.append(SweepRun(policy, rate, result, summary))
    return runs


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_summary(s: Summary) -> str:
    return (f"SLO {_fmt(s.slo_attainment, 100, 1)}%, goodput {_fmt(s.goodput_rps)}/s, "
            f"throughput {s.throughput_rps:.2f}/s, P50 {_fmt(s.latency_p50_s)} s, P95 {_fmt(s.latency_p95_s)} s, "
            f"P99 {_fmt(s.latency_p99_s)} s, rejected {s.failed}")


def print_table(runs: Sequence[SweepRun]) -> None:
    print(f"{'policy':<18}{'rate':>7}{'ok/count':>12}{'SLO %':>8}{'goodput':>9}{'thruput':>9}"
          f"{'P50 s':>8}{'P95 s':>8}{'P99 s':>8}{'wait s':>8}{'busy':>6}")
    for run in runs:
        s = run.summary
        print(f"{run.policy:<18}{run.rate:>7g}{f'{s.ok}/{s.count}':>12}{_fmt(s.slo_attainment, 100, 1):>8}"
              f"{_fmt(s.goodput_rps):>9}{s.throughput_rps:>9.2f}{_fmt(s.latency_p50_s):>8}{_fmt(s.latency_p95_s):>8}"
              f"{_fmt(s.latency_p99_s):>8}{_fmt(s.queue_wait_mean_s):>8}{_fmt(s.busy_fraction):>6}")


def sweep_report(kind: str, spec: WorkloadSpec, profile: str, config: SimConfig, runs: Sequence[SweepRun],
                 traces: bool) -> dict[str, Any]:
    base = config.describe()
    base.pop("policy", None)
    base.pop("policy_options", None)
    return {
        "benchmark": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "profile": profile,
        "workload": describe(spec),
        "cluster": base,
        "runs": [
            {
                "policy": run.policy, "policy_options": dict(run.result.config.policy_options), "rate": run.rate,
                "summary": asdict(run.summary),
                "simulation": {
                    "requests": len(run.result.traces), "simulated_s": run.result.end_s, "wall_s": run.result.wall_s,
                    "decision_wall_s": sum(run.result.decision_wall_s), "events": run.result.events,
                    "decisions": run.result.decisions, "rounds": run.result.rounds,
                    "text_encoder_busy_s": run.result.text_encoder_busy_s,
                    "decoder_busy_s": run.result.decoder_busy_s, "worker_busy_s": dict(run.result.busy_s),
                },
                **({"traces": [asdict(t) for t in run.result.traces]} if traces else {}),
            }
            for run in runs
        ],
    }


def write_outputs(out: Path, stem: str, report: dict[str, Any], runs: Sequence[SweepRun], title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.json"]
    written[0].write_text(json.dumps(report, indent=1))
    policies = list(dict.fromkeys(run.policy for run in runs))
    rates = list(dict.fromkeys(run.rate for run in runs))

    panels = {
        f"{rate:g} req/s": {run.policy: [r.latency_s for r in run.result.records() if r.ok]
                            for run in runs if run.rate == rate}
        for rate in rates
    } if len(policies) > 1 else {
        "latency CDF": {f"{run.rate:g} req/s": [r.latency_s for r in run.result.records() if r.ok] for run in runs}
    }
    path = out / f"{stem}_latency_cdf.png"
    plot_latency_cdfs(panels, title, path)
    written.append(path)
    sweeps = {p: [(run.rate, run.summary) for run in runs if run.policy == p] for p in policies}
    if len(rates) > 1:
        path = out / f"{stem}_vs_load.png"
        plot_load_sweep(sweeps, title, path)
        written.append(path)
    if len(policies) > 1:
        path = out / f"{stem}_bars.png"
        plot_policy_bars(sweeps, title, path)
        written.append(path)
    return written
