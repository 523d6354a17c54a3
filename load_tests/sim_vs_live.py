"""The simulator against the live system: the same requests, the same profile, side by side.

For each policy the app from a Serve config (default: configs/local-tiny.yaml) is deployed on a
lean local Ray, warmed up, and driven open-loop over HTTP with a workload's requests (images
with /v1/images/generations, videos as /v1/videos jobs long-polled until they end); the simulator
then runs exactly those requests (same offsets, steps, sizes, frames) with the cluster taken
from the same config, timed by a cost profile, with every component sharing this machine's
CPUs (`SimConfig.host_cpus`). It prints both P50/P95 and the simulator's error: for the whole
run, and for images and videos apart when the workload has both.

    python -m stepserve.load_tests.sim_vs_live --out results/sim-vs-live
    python -m stepserve.load_tests.sim_vs_live --out results/sim-vs-live-video \\
        --config configs/local-video.yaml --workload local-video-tiny --policies genserve

By default the profile is measured first (`stepserve profile` for each of the workload's
models at its sizes, a video model also at its frame counts, into <out>/profile-<model>.csv),
on the same quiet machine, minutes before the live runs: the 2-core VM's speed drifts by tens
of percent within an hour, so a profile from another time compares two different machines.
`--profile NAME_OR_CSV[,NAME_OR_CSV...]` uses existing ones instead.

One live run is not a measurement to hold a model to: on the 2-core VM the same requests
replayed minutes apart move the live P95 by ±20%. So each policy and rate runs live `--repeats` times
(3 by default), interleaved (every policy once, then again), and the verdict compares the
simulator, which is deterministic, with the median of the runs' P50s and P95s; every run's own
numbers are reported beside it. A measured profile is measured again before every round of runs
(`<out>/profile-<i>/`), and the simulator is timed by their median (`<out>/profile-<model>.csv`,
`host_speed.median_profile`): the VM's speed moves within a minute, so one profile taken before
all the runs is one sample of it, and a profile spread over the runs' own minutes is the fair
one to hold them to.

A profile measures the machine at rest, and on this VM the workers' speed under load does not
follow it: between two benchmarks 40 minutes apart the profile's forward got 13-15% slower
while the live step under load got 5% faster, which moved the simulator's P50 by 20 points
with the live runs holding still; and live runs minutes apart differ by up to 1.8x in P50. So
by default (`--calibrate`) each live run gets a simulated twin at that run's speed: every time
a model's profile measured in process (forwards, text encoding, decodes) is multiplied by one
factor, chosen so that the simulated mean step of that model's requests (the router's `step`
stage, denoise / steps) equals the run's (`fit_speed`); what the profile measured through the
live app (round and request overheads, router CPU) stays. Only the speed is fitted; the
relative costs, the batches, queues, decisions and tails are the simulator's, and the median
of the twins' P50 and P95 is held to the bar. The simulator on the profile as measured is
reported beside the verdict (`as_profiled`).

Both sides decide on the same costs and deadlines: when the config names `router.profiles`
(policies that predict step times need them), the live router gets the comparison's profile
in their place; and the simulator schedules every request against the SLO the live server
gives it (its model's `slo_s`), while both report SLO attainment against the workload's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.bench_batching import run_policy
from stepserve.load_tests.local_app import free_port, local_ray, log, served_router
from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.plots import plot_sim_vs_live
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.sweep import parse_rates, sim_config_from_serve
from stepserve.load_tests.workload import ScheduledRequest, generate, load_workload
from stepserve.runtime import tiny_config_path, load_serve_config

TOLERANCE = 0.15  # the bar for P50 and P95
# The speed fit stops when every kind's simulated mean step is within 1% of the live one, or
# after this many simulations of every run (genserve's decisions move with the speed).
CALIBRATION_TOLERANCE, CALIBRATION_TRIES = 0.01, 6
# Completed live requests a kind needs before its own P50/P95 are held to the bar: the P95 of
# fewer is one or two requests' latency, which a single preemption moves by tens of percent.
MIN_KIND_REQUESTS = 20
KINDS = ("image", "video")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.sim_vs_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for sim_vs_live.json and .png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(),
                        help="Serve config to deploy and to take the simulated cluster from (default: %(default)s)")
    parser.add_argument("--workload", default="local-tiny",
                        help="workload YAML or shipped name (default: %(default)s)")
    parser.add_argument("--profile", default="measure",
                        help="cost profile: CSV paths or shipped names, comma-separated (one per model, e.g. "
                             "tiny-sd-cpu,tiny-wan-cpu), or 'measure' to profile this machine first "
                             "(default: %(default)s)")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="simulate each live run at the speed fitted to its mean step (one factor per model "
                             "on the profile's in-process times) and hold those to the bar; the profile as "
                             "measured is reported beside it (default: on)")
    parser.add_argument("--rates", type=parse_rates, default=None,
                        help="offered rates, req/s, comma-separated (default: the workload's own)")
    parser.add_argument("--policies", nargs="+", default=["continuous"], help="policies to run (default: continuous)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="live runs of each policy and rate, interleaved; the verdict holds the simulator to "
                             "the median of their P50s and P95s (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=None, help="override the workload's duration, s")
    parser.add_argument("--warmup", type=int, default=6, help="requests sent before each measured run")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request counts as failed")
    parser.add_argument("--host-cpus", type=float, default=os.cpu_count(),
                        help="cores the simulated app shares (default: this machine's, %(default)s)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="largest |sim/live - 1| for P50 and P95 counted as agreement (default: %(default)s)")
    parser.add_argument("--min-kind-requests", type=int, default=MIN_KIND_REQUESTS,
                        help="completed live requests images or videos need before their own P50/P95 are held to "
                             "the tolerance, in a workload with both (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def kind_of(request: ScheduledRequest) -> str:
    return "video" if request.is_video else "image"


def split_by_kind(records: Sequence[RequestRecord], kinds: Mapping[int, str]) -> dict[str, list[RequestRecord]]:
    """Records per kind ("image", "video"), by their workload index; kinds with none are left out."""
    out: dict[str, list[RequestRecord]] = {}
    for record in records:
        out.setdefault(kinds[record.index], []).append(record)
    return {kind: out[kind] for kind in KINDS if kind in out}


@dataclass(frozen=True)
class Comparison:
    policy: str
    rate: float
    live: Summary
    sim: Summary
    live_records: list[RequestRecord]
    sim_records: list[RequestRecord]
    server: dict[str, Any]  # the live router's histogram means
    # (live, simulated) per kind; only when the workload has both images and videos.
    kinds: dict[str, tuple[Summary, Summary]] = field(default_factory=dict)
    request_kinds: dict[int, str] = field(default_factory=dict)  # workload index -> "image" | "video"
    # Per kind served, the mean seconds of each router stage (text_encode, queue, denoise, step,
    # decode), live (the router's stage histogram) and simulated: where the two part ways.
    stages: dict[str, dict[str, tuple[float | None, float | None]]] = field(default_factory=dict)
    # The live runs this one stands for when there were several (`median_of`): then `live` and
    # the live side of `kinds` are their medians, and `live_records` all their records.
    repeats: tuple[Comparison, ...] = ()
    # With the simulator's speed fitted to the live run (`fit_speed`): the fit, and the same
    # live runs against the simulator on the profile as measured.
    calibration: Calibration | None = None
    as_profiled: Comparison | None = None

    def summaries(self, kind: str | None = None) -> tuple[Summary, Summary]:
        return (self.live, self.sim) if kind is None else self.kinds[kind]

    def error(self, stat: str, kind: str | None = None) -> float | None:
        """sim / live - 1 for a Summary field such as latency_p50_s, of the run or of one kind."""
        live_summary, sim_summary = self.summaries(kind)
        return _error(getattr(live_summary, stat), getattr(sim_summary, stat))

    def within(self, tolerance: float, kind: str | None = None) -> bool:
        errors = [self.error("latency_p50_s", kind), self.error("latency_p95_s", kind)]
        return all(e is not None and abs(e) <= tolerance for e in errors)

    def held(self, min_requests: int = MIN_KIND_REQUESTS) -> list[str | None]:
        """What the bar applies to: the whole run (None), and each kind with at least
        `min_requests` completed live requests."""
        return [None] + [kind for kind, (live, _) in self.kinds.items() if live.ok >= min_requests]

    def agrees(self, tolerance: float, min_requests: int = MIN_KIND_REQUESTS) -> bool:
        return all(self.within(tolerance, k) for k in self.held(min_requests)) and not self.live.failed


def median(values: Sequence[float | None]) -> float | None:
    """The median of the known values (None when none is)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def median_summary(summaries: Sequence[Summary]) -> Summary:
    """Several runs of the same requests as one: each statistic the median over the runs; the
    counts the worst run's (fewest ok, most failed), so a failure in any run is kept."""
    fields = {name: median([getattr(s, name) for s in summaries]) for name in Summary.__dataclass_fields__}
    fields.update(count=min(s.count for s in summaries), ok=min(s.ok for s in summaries),
                  failed=max(s.failed for s in summaries), slo_count=min(s.slo_count for s in summaries),
                  slo_met=min(s.slo_met for s in summaries))
    return Summary(**fields)


def median_of(runs: Sequence[Comparison]) -> Comparison:
    """Live repeats of one policy and rate, each against its simulated twin (the same simulated
    run for all, or one at each run's fitted speed), as one comparison: every statistic (of the
    run and of each kind) and stage mean is the median over the repeats, on each side; the runs
    themselves stay in `repeats`."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    kinds = {kind: tuple(median_summary([r.kinds[kind][side] for r in runs]) for side in (0, 1))
             for kind in first.kinds}
    stages = {kind: {stage: tuple(median([r.stages.get(kind, {}).get(stage, (None, None))[side] for r in runs])
                                  for side in (0, 1))
                     for stage in pairs}
              for kind, pairs in first.stages.items()}
    return replace(first, live=median_summary([r.live for r in runs]), sim=median_summary([r.sim for r in runs]),
                   kinds=kinds, stages=stages, live_records=[record for r in runs for record in r.live_records],
                   sim_records=[record for r in runs for record in r.sim_records], server={}, calibration=None,
                   repeats=tuple(runs))


def _error(live: float | None, sim: float | None) -> float | None:
    return None if not live or sim is None else sim / live - 1


def stage_pairs(live: Mapping[str, Mapping[str, float | None]], sim: Callable[[str], Mapping[str, float | None]]
                ) -> dict[str, dict[str, tuple[float | None, float | None]]]:
    """(live, simulated) mean of each router stage, per kind the live router served. `live` is
    `PolicyRun.stages` (keys such as "router.queue"), `sim(kind)` the simulator's `stage_means`."""
    return {kind: {stage: (means.get(f"router.{stage}"), simulated)
                   for stage, simulated in sim(kind).items()}
            for kind, means in live.items()}


def make_comparison(policy: str, rate: float, requests: Sequence[ScheduledRequest], live_records: list[RequestRecord],
                    sim_records: list[RequestRecord], sim_busy_s: Mapping[str, float] | None,
                    server: dict[str, Any],
                    stages: dict[str, dict[str, tuple[float | None, float | None]]] | None = None) -> Comparison:
    """Both runs summarized, as a whole and, when the requests mix images and videos, per kind
    (per-kind summaries carry no busy fraction: the workers are shared)."""
    kinds = {r.index: kind_of(r) for r in requests}
    per_kind: dict[str, tuple[Summary, Summary]] = {}
    if len(set(kinds.values())) > 1:
        live_split, sim_split = split_by_kind(live_records, kinds), split_by_kind(sim_records, kinds)
        per_kind = {kind: (summarize(live_split.get(kind, [])), summarize(sim_split.get(kind, [])))
                    for kind in KINDS if kind in live_split or kind in sim_split}
    return Comparison(policy, rate, summarize(live_records, None, rate), summarize(sim_records, sim_busy_s, rate),
                      live_records, sim_records, server, per_kind, kinds, stages or {})


def profile_commands(config: Path, out: Path, requests: Sequence[ScheduledRequest]) -> list[tuple[list[str], Path]]:
    """One `stepserve profile` command line per model the requests use, at their (square) sizes,
    and where it writes. A video model (`stepserve profile` tells it by its family) profiles
    its own frame grid; the cost model scales a video's work by pixels x frames between the
    grid's counts, so the workload's frame counts need not be on it (`frame_notes` says)."""
    commands = []
    for model in sorted({r.model for r in requests if r.model is not None}):
        sizes = sorted({max(r.width, r.height) for r in requests if r.model == model})
        path = out / f"profile-{model}.csv"
        command = [sys.executable, "-m", "stepserve.cli", "profile", "--model", model, "--device", "cpu",
                   "--config", str(config), "--sizes", *map(str, sizes), "--out", str(path)]
        commands.append((command, path))
    return commands


def frame_notes(requests: Sequence[ScheduledRequest], grid_frames: Sequence[int]) -> list[str]:
    """A note per video model whose requests ask for frame counts the profile grid lacks."""
    notes = []
    for model in sorted({r.model for r in requests if r.is_video and r.model is not None}):
        frames = sorted({r.num_frames for r in requests if r.is_video and r.model == model})
        missing = [f for f in frames if f not in grid_frames]
        if missing:
            notes.append(f"note: {model} requests ask for {missing} frames; the profile measures {list(grid_frames)}, "
                         "and the cost model scales between them by pixels x frames")
    return notes


def measure_profile(config: Path, out: Path, requests: list) -> list[Path]:
    """`stepserve profile` for every model in the requests, at their sizes, into one CSV each
    in `out`."""
    if any(r.is_video for r in requests):
        from stepserve.profiling.video import GRIDS  # torch: only when a video model is measured

        for note in frame_notes(requests, GRIDS["cpu"].frames):
            log(note)
    paths = []
    for command, path in profile_commands(config, out, requests):
        log("measuring the profile: " + " ".join(command[2:]))
        subprocess.run(command, check=True)
        paths.append(path)
    return paths


def live_serve_config(serve_config: dict[str, Any], profiles: Sequence[str]) -> dict[str, Any]:
    """The config to deploy: when it names `router.profiles`, those are replaced by the
    comparison's own (as absolute CSV paths), so the live router predicts with the costs the
    simulator is timed by. A config without them (local-tiny.yaml) is deployed as it is."""
    from stepserve.policies.cost_model import resolve_profile

    config = copy.deepcopy(serve_config)
    router = config["applications"][0].get("args", {}).get("router") or {}
    if router.get("profiles"):
        router["profiles"] = [str(resolve_profile(p).resolve()) for p in profiles]
    return config


def served_policy(serve_config: dict[str, Any], policy: str) -> tuple[dict[str, Any], dict[str, float | None]]:
    """What the live app runs with `router.policy` replaced (as `bench_serve_config` deploys
    it): the policy options its router builds, and each model's SLO in seconds (None: none)."""
    from stepserve.deployments.config import AppConfig  # heavy (ray, torch): only when asked

    args = copy.deepcopy(serve_config["applications"][0].get("args", {}))
    args["router"] = served_router(args.get("router") or {}, policy)
    app = AppConfig.model_validate(args)
    return app.policy_options(), {m.name: m.slo_s for m in app.models}


def as_served(requests: Sequence[ScheduledRequest], slos: Mapping[str, float | None]) -> list[ScheduledRequest]:
    """The requests as the live router schedules them: with their model's SLO from the config,
    not the workload's σ × solo latency (the HTTP API carries no per-request SLO)."""
    return [replace(r, slo_s=slos.get(r.model)) for r in requests]


def with_workload_slos(records: Sequence[RequestRecord], requests: Sequence[ScheduledRequest]) -> list[RequestRecord]:
    """Records measured against the workload's SLOs again, as the live records are."""
    slo = {r.index: r.slo_s for r in requests}
    return [replace(record, slo_s=slo[record.index]) for record in records]


@dataclass(frozen=True)
class Calibration:
    """The simulator's speed fitted to the live runs (`fit_speed`)."""

    factors: dict[str, float]  # model -> the factor on every time of its profile
    residuals: dict[str, float]  # kind -> simulated / live mean step - 1 at those factors
    simulations: int  # simulations of every run the fit took


def fit_speed(live_steps: Mapping[str, float], models: Mapping[str, set[str]],
              simulated_steps: Callable[[dict[str, float]], Mapping[str, float]],
              tolerance: float = CALIBRATION_TOLERANCE, tries: int = CALIBRATION_TRIES) -> Calibration:
    """Per model, the factor on its profile's times at which `simulated_steps(factors)` (kind ->
    simulated mean step) meets `live_steps` (kind -> the live one): each kind's factor is
    multiplied by live / simulated until every kind is within `tolerance`, or the closest of
    `tries` (a step's time is nearly proportional to the factor, but the batches the simulator
    forms, and genserve's decisions, move with it). `models`: kind -> the models its requests
    use; a kind with no live step keeps its models' times."""
    owners: dict[str, str] = {}
    for kind, names in models.items():
        for model in names:
            if owners.setdefault(model, kind) != kind:
                raise ValueError(f"model {model} serves both {owners[model]} and {kind} requests: its speed "
                                 "cannot be fitted to each kind's steps apart")
    factors = {kind: 1.0 for kind in live_steps if live_steps[kind]}
    best: Calibration | None = None
    for attempt in range(1, tries + 1):
        per_model = {model: factors[kind] for kind in factors for model in models.get(kind, ())}
        simulated = simulated_steps(per_model)
        residuals = {kind: simulated[kind] / live_steps[kind] - 1 for kind in factors if simulated.get(kind)}
        worst = max(map(abs, residuals.values()), default=0.0)
        if best is None or worst < max(map(abs, best.residuals.values()), default=0.0):
            best = Calibration(per_model, residuals, attempt)
        if worst <= tolerance:
            break
        factors = {kind: f / (1 + residuals[kind]) if kind in residuals else f for kind, f in factors.items()}
    assert best is not None
    return replace(best, simulations=attempt)


def models_by_kind(requests: Iterable[ScheduledRequest]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in requests:
        if r.model is not None:
            out.setdefault(kind_of(r), set()).add(r.model)
    return out


def compare(args: argparse.Namespace) -> list[Comparison]:
    """Every policy and rate live `--repeats` times, then simulated: on the profile as measured,
    and (`--calibrate`) once for each live run at the speed fitted to it, which the verdict then
    holds."""
    serve_config = load_serve_config(args.config)
    spec = load_workload(args.workload)
    if args.duration is not None:
        spec = replace(spec, duration_s=args.duration, num_requests=None)
    sim_config = SimConfig(**{**sim_config_from_serve(args.config), "host_cpus": args.host_cpus})
    served = {policy: served_policy(serve_config, policy) for policy in args.policies}  # a bad policy fails here
    profiles, requests_at, lives = run_live(args, serve_config, spec)
    args.profile = ",".join(profiles)
    models = models_by_kind(r for rs in requests_at.values() for r in rs)
    return [simulated_twins(policy, rate, runs, requests_at[rate], served[policy], profiles,
                            replace(sim_config, policy=policy, policy_options=served[policy][0]), models,
                            args.calibrate)
            for (policy, rate), runs in lives.items()]


def run_live(args: argparse.Namespace, serve_config: dict[str, Any], spec: Any
             ) -> tuple[list[str], dict[float, list[ScheduledRequest]], dict[tuple[str, float], list[Any]]]:
    """Every policy and rate live `--repeats` times, interleaved, the profile measured again
    before every round when measuring. Returns the profiles to simulate on (with several
    measured, their per-point median), the requests at each rate, and each policy and rate's
    live runs (`PolicyRun`s)."""
    from stepserve.load_tests.host_speed import median_profile
    from stepserve.policies.cost_model import load_profile

    measuring = args.profile == "measure"
    profiles = [] if measuring else [p.strip() for p in args.profile.split(",") if p.strip()]
    measured: list[list[Path]] = []
    requests_at: dict[float, list[ScheduledRequest]] = {}
    lives: dict[tuple[str, float], list[Any]] = {}
    port = free_port()  # one for all apps: Serve keeps the HTTP options it first started with
    for repeat in range(args.repeats):  # outermost: drift hits every policy alike
        if measuring:  # again before every round of runs: the profile spans the runs' minutes
            folder = args.out if args.repeats == 1 else args.out / f"profile-{repeat + 1}"
            measured.append(measure_profile(args.config, folder, generate(spec)))
            profiles = [str(p) for p in measured[-1]]
        cost = load_profile(*profiles)
        live_config = live_serve_config(serve_config, profiles)  # the live router predicts with the latest
        with local_ray(int(os.cpu_count() or 1)):
            for policy in args.policies:
                for rate in args.rates or [spec.mean_rate]:
                    # The same requests every run (their SLOs from the first profile).
                    requests = requests_at.setdefault(rate, generate(spec.with_rate(rate), cost))
                    warmup = generate(replace(spec.with_rate(rate), seed=spec.seed + 1, duration_s=None,
                                              num_requests=args.warmup), cost) if args.warmup else []
                    what = f"[{policy} @ {rate:g} req/s, run {repeat + 1}/{args.repeats}]"
                    log(f"{what} live: {len(requests)} requests ...")
                    started = time.monotonic()
                    live = run_policy(live_config, port, policy, warmup, requests, args.request_timeout)
                    log(f"{what} live done in {time.monotonic() - started:.0f} s")
                    lives.setdefault((policy, rate), []).append(live)
    if len(measured) > 1:  # per model, the median over the profiles taken between the runs
        profiles = [str(median_profile([m[i] for m in measured], args.out / measured[0][i].name))
                    for i in range(len(measured[0]))]
        log(f"simulating on the median of {len(measured)} profiles: {', '.join(profiles)}")
    return profiles, requests_at, lives


def simulated_twins(policy: str, rate: float, runs: Sequence[Any], requests: list[ScheduledRequest],
                    served: tuple[dict[str, Any], dict[str, float | None]], profiles: Sequence[str],
                    config: SimConfig, models: Mapping[str, set[str]], calibrate: bool) -> Comparison:
    """One policy and rate's live runs against the simulator on the same requests: on the
    profile as measured, and (`calibrate`) each run against its twin at the speed fitted to it
    (then the profile's own is `as_profiled`)."""
    from stepserve.load_tests.host_speed import scaled_profile
    from stepserve.policies.cost_model import load_profile

    scheduled = as_served(requests, served[1])

    def twin(live: Any, result: Any) -> Comparison:
        return make_comparison(policy, rate, requests, live.records, with_workload_slos(result.records(), requests),
                               result.busy_s, live.server, stage_pairs(live.stages, result.stage_means))

    profiled = simulate(scheduled, load_profile(*profiles), config)
    as_profiled = median_of([twin(live, profiled) for live in runs])
    if not calibrate:
        return as_profiled
    fitted = []
    for i, live in enumerate(runs, 1):  # each run at its own speed: the VM's moves between runs
        results: dict[tuple, Any] = {}

        def simulated_steps(factors: dict[str, float], live: Any = live,
                            results: dict[tuple, Any] = results) -> dict[str, float | None]:
            result = results[tuple(sorted(factors.items()))] = simulate(
                scheduled, scaled_profile(profiles, factors), config)
            return {kind: result.stage_means(kind)["step"] for kind in live.stages}

        live_steps = {kind: means.get("router.step") for kind, means in live.stages.items()}
        calibration = fit_speed(live_steps, models, simulated_steps)
        log(f"[{policy} @ {rate:g} req/s, run {i}] the simulator's speed fitted: {describe(calibration)}")
        fitted.append(replace(twin(live, results[tuple(sorted(calibration.factors.items()))]),
                              calibration=calibration))
    return replace(median_of(fitted), as_profiled=as_profiled)


def describe(calibration: Calibration) -> str:
    factors = ", ".join(f"{model} x{f:.3f}" for model, f in sorted(calibration.factors.items()))
    residuals = ", ".join(f"{kind} {r:+.1%}" for kind, r in calibration.residuals.items())
    return (f"profile times {factors or '(none: no live step)'}; simulated / live mean step - 1: "
            f"{residuals or '-'} ({calibration.simulations} simulations)")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _label(c: Comparison, kind: str | None) -> str:
    return c.policy if kind is None else f"  {kind}"


def print_table(comparisons: list[Comparison], tolerance: float, min_requests: int = MIN_KIND_REQUESTS) -> None:
    print(f"\nlatency in s from scheduled send to response; error = sim / live - 1 (agreement: within "
          f"±{tolerance:.0%})")
    if any(c.kinds for c in comparisons):
        print(f"a video's latency ends at the answer to its long poll, when it completed; images and videos are "
              f"held to the bar apart when at least {min_requests} of them completed live; 'agrees' on a run's "
              f"first row is the run's verdict")
    if any(c.repeats for c in comparisons):
        print("live: the median over the live runs, each listed below its verdict (sim against that run alone)")
    if any(c.as_profiled for c in comparisons):
        print("sim: at the speed fitted to each live run's steps (the median over the runs' twins); 'as profiled': "
              "the simulator at the profile's own speed")
    print(f"{'policy':<13}{'req/s':>6}{'ok':>9}{'live P50':>10}{'sim P50':>9}{'err':>8}"
          f"{'live P95':>10}{'sim P95':>9}{'err':>8}  agrees")
    for c in comparisons:
        for kind in (None, *c.kinds):
            live = c.summaries(kind)[0]
            if kind is None:
                verdict = "yes" if c.agrees(tolerance, min_requests) else "NO"
            elif kind in c.held(min_requests):
                verdict = "yes" if c.within(tolerance, kind) else "NO"
            else:
                verdict = f"not held ({live.ok} ok < {min_requests})"
            _row(c, kind, _label(c, kind), verdict)
        for i, run in enumerate(c.repeats, 1):
            speed = "" if run.calibration is None else "; speed " + ", ".join(
                f"{model} x{f:.2f}" for model, f in sorted(run.calibration.factors.items()))
            for kind in (None, *run.kinds):
                _row(run, kind, f"  run {i}" + (f" {kind}" if kind else ""), f"(one run{'' if kind else speed})")
        if c.as_profiled is not None:
            for kind in (None, *c.as_profiled.kinds):
                _row(c.as_profiled, kind, "  as profiled" + (f" {kind}" if kind else ""), "(profile's speed)")
    for c in comparisons:
        for kind, pairs in c.stages.items():
            cells = "  ".join(f"{stage} {_ms(live)}/{_ms(sim)}" for stage, (live, sim) in pairs.items())
            print(f"{c.policy} @ {c.rate:g} req/s, {kind} stages, ms live/sim: {cells}")


def _row(c: Comparison, kind: str | None, label: str, verdict: str) -> None:
    live, sim = c.summaries(kind)
    print(f"{label:<13}{c.rate:>6g}{f'{live.ok}/{live.count}':>9}{_s(live.latency_p50_s):>10}"
          f"{_s(sim.latency_p50_s):>9}{_pct(c.error('latency_p50_s', kind)):>8}{_s(live.latency_p95_s):>10}"
          f"{_s(sim.latency_p95_s):>9}{_pct(c.error('latency_p95_s', kind)):>8}  {verdict}")


STATS = ("latency_p50_s", "latency_p95_s", "latency_p99_s", "latency_mean_s")


def _records(records: Sequence[RequestRecord], kinds: Mapping[int, str]) -> list[dict[str, Any]]:
    return [{**asdict(r), "kind": kinds[r.index]} if r.index in kinds else asdict(r) for r in records]


def run_report(c: Comparison, tolerance: float, min_requests: int = MIN_KIND_REQUESTS) -> dict[str, Any]:
    """One run's JSON: the whole run as before, plus per kind when the workload mixes them;
    `held` lists what the bar was applied to ("all" and the kinds with enough requests)."""
    held = c.held(min_requests)
    return {
        "policy": c.policy, "rate": c.rate, "agrees": c.agrees(tolerance, min_requests),
        "held": ["all" if k is None else k for k in held],
        "error": {stat: c.error(stat) for stat in STATS},
        "live": asdict(c.live), "sim": asdict(c.sim),
        # The simulator's speed fitted to this live run (None: on the profile as measured, or a
        # median over runs, each of which has its own).
        "calibration": None if c.calibration is None else asdict(c.calibration),
        # The simulator at the profile's own speed (when the verdict's is fitted to the live runs).
        "as_profiled": None if c.as_profiled is None else {
            "error": {stat: c.as_profiled.error(stat) for stat in STATS}, "sim": asdict(c.as_profiled.sim),
            "kinds": {kind: {"error": {stat: c.as_profiled.error(stat, kind) for stat in STATS}}
                      for kind in c.as_profiled.kinds},
            "stages_s": {kind: {stage: sim for stage, (_, sim) in pairs.items()}
                         for kind, pairs in c.as_profiled.stages.items()},
            "sim_records": _records(c.as_profiled.sim_records, c.request_kinds)},
        "live_server": c.server,
        "stages_s": {kind: {stage: {"live": live, "sim": sim} for stage, (live, sim) in pairs.items()}
                     for kind, pairs in c.stages.items()},
        "kinds": {kind: {"held": kind in held, "within": c.within(tolerance, kind),
                         "error": {stat: c.error(stat, kind) for stat in STATS},
                         "live": asdict(live), "sim": asdict(sim)}
                  for kind, (live, sim) in c.kinds.items()},
        # Several live runs: each its own report, with its own simulated twin's records when the
        # speed was fitted to each (else the one simulated run's records are given once, here).
        "repeats": [{k: v for k, v in run_report(r, tolerance, min_requests).items()
                     if k != "sim_records" or r.calibration is not None} for r in c.repeats],
        "live_records": [] if c.repeats else _records(c.live_records, c.request_kinds),
        "sim_records": [] if c.repeats and c.repeats[0].calibration is not None
        else _records(c.repeats[0].sim_records if c.repeats else c.sim_records, c.request_kinds),
    }


def report(args: argparse.Namespace, comparisons: list[Comparison]) -> dict[str, Any]:
    return {
        "benchmark": "sim_vs_live",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "config_path": str(args.config), "workload": args.workload, "profile": str(args.profile),
        "host_cpus": args.host_cpus, "tolerance": args.tolerance, "min_kind_requests": args.min_kind_requests,
        "runs": [run_report(c, args.tolerance, args.min_kind_requests) for c in comparisons],
    }


def plot_panels(comparisons: list[Comparison]) -> tuple[dict[str, dict[str, list[float]]],
                                                        list[tuple[str, float | None, float | None]]]:
    """CDF panels (one per run; a mixed run's shows images and videos apart; with a fitted speed
    also the simulator as profiled) and error bars (each run, then each of its kinds)."""
    panels: dict[str, dict[str, list[float]]] = {}
    errors: list[tuple[str, float | None, float | None]] = []
    for c in comparisons:
        name = f"{c.policy} @ {c.rate:g}"
        sides = {f"live ({len(c.repeats)} runs)" if c.repeats else "live": c.live_records,
                 "simulated": c.sim_records}
        if c.as_profiled is not None:
            sides["simulated as profiled"] = c.as_profiled.sim_records
        if not c.kinds:
            panels[f"{name} req/s"] = {side: [r.latency_s for r in records if r.ok] for side, records in sides.items()}
        else:
            split = {side: split_by_kind(records, c.request_kinds) for side, records in sides.items()}
            panels[f"{name} req/s"] = {
                f"{side} {kind}": [r.latency_s for r in by_kind.get(kind, []) if r.ok]
                for kind in c.kinds for side, by_kind in split.items()
            }
        errors.append((name, c.error("latency_p50_s"), c.error("latency_p95_s")))
        errors += [(f"{name} {kind}", c.error("latency_p50_s", kind), c.error("latency_p95_s", kind))
                   for kind in c.kinds]
    return panels, errors


def plot_title(workload: str, profiles: str, fitted: bool) -> str:
    names = ", ".join(Path(p).name for p in profiles.split(","))
    return f"{workload}: simulated vs live (profile {names}{'; speed fitted to each live run' if fitted else ''})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        comparisons = compare(args)
    except (ValueError, FileNotFoundError) as exc:  # bad workload, profile or config
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.out / "sim_vs_live.json").write_text(json.dumps(report(args, comparisons), indent=1))
    panels, errors = plot_panels(comparisons)
    plot_sim_vs_live(panels, errors, args.tolerance, plot_title(args.workload, args.profile, args.calibrate),
                     args.out / "sim_vs_live.png")
    print_table(comparisons, args.tolerance, args.min_kind_requests)
    print(f"wrote {args.out / 'sim_vs_live.json'} and {args.out / 'sim_vs_live.png'}")
    return 0 if all(c.agrees(args.tolerance, args.min_kind_requests) for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
