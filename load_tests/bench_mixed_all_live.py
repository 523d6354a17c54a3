"""Everything at once, live, on the CPU twin (`configs/local-all.yaml`): the composed policy against
GenServe's policy and static FCFS at two load points, `bench_mixed_all_sim`'s mix at the scale of
this machine (issue 36).

The mix, on the twin's two workers (with its ControlNet service, text encoder, VAE decoder,
activation store and LoRA store):

- tiny-sd images at 64, 96 and 128 px in equal shares, 20 steps with CFG, each with the `canny`
  ControlNet (run by the ControlNet service) and the `papercut` LoRA each with probability
  `--addon-share`;
- tiny-sd3 edits (`--edit-share` of the requests) of two templates at 64 px, masks after
  InstGenIE's public trace (on SD3's 16-px grid: a quarter of the image at most cells); the
  warm-up's edit of each template records its activations, so the measured ones are cached edits;
- tiny-wan videos (`--video-share`), 128x128, 17 frames, 20 steps (the twin's largest: the long
  jobs of the mix, as a GPU's videos are).

Each request carries its own SLO (`slo_s` in the body, so the server schedules by it):
`--image-slo` (images and edits) or `--video-slo` (videos) x the solo latency of a request of its
kind, size and add-ons, measured live on the first variant's idle, warmed app (the median of
`--solo-repeats`). Then for each variant the app is deployed with only `router.policy` changed
(the options it takes kept: `local_app.served_router`), warmed up, driven open-loop at each rate
with the same requests (same seed; a rate only moves them closer together), and deleted. A
request refused (429) or unanswered within `--request-timeout` counts as a miss.

    python -m stepserve.load_tests.bench_mixed_all_live --out docs/results/mixed-all-live

Writes mixed_all_live.json (setup, solo latencies, per variant and rate the summary, SLO
attainment by class, every record) and mixed_all_live.png (attainment by class, one panel a rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stepserve.load_tests.addon_mix import AddonMix
from stepserve.load_tests.edit_workload import EditMix, with_edits
from stepserve.load_tests.live import one_by_one, run_open_loop, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import summarize
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.sweep import format_summary, parse_rates
from stepserve.load_tests.workload import (PoissonArrivals, RequestClass, ScheduledRequest, SizeChoice, StepsChoice,
                                           WorkloadSpec, generate)
from stepserve.runtime import CONFIGS, load_serve_config

CLASSES = ("image", "edit", "video")
TEMPLATES = 2
SOLO_MASK = 0.25  # the mask of the edit whose solo latency sets the edits' SLO (the trace's mean on the grid)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_mixed_all_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for mixed_all_live.json and .png")
    parser.add_argument("--config", type=Path, default=CONFIGS / "local-all.yaml",
                        help="the CPU twin's Serve config (default: %(default)s)")
    parser.add_argument("--variants", default="composed,genserve,static_fcfs",
                        help="router policies, comma-separated, in run order (default: %(default)s)")
    # On the 2-core VM the twin served this mix at about 4 req/s at most (20 s smoke runs: composed
    # 97% of SLOs met at 2-3 req/s, 38% at 5): one load point at half of that, one near it.
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("2,3.5"),
                        help="offered req/s, comma-separated (default: 2,3.5)")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of arrivals a rate (default: %(default)s)")
    parser.add_argument("--edit-share", type=float, default=0.3, help="share of requests that are edits")
    parser.add_argument("--video-share", type=float, default=0.1, help="share of requests that are videos")
    parser.add_argument("--addon-share", type=float, default=0.3,
                        help="probability of the ControlNet, and of the LoRA, on an image (default: %(default)s)")
    parser.add_argument("--image-slo", type=float, default=5.0, help="images' and edits' SLO, x solo latency")
    parser.add_argument("--video-slo", type=float, default=2.0, help="videos' SLO, x solo latency")
    parser.add_argument("--solo-repeats", type=int, default=3, help="solo requests a kind, median taken")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take before it counts as failed (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(),
                        help="CPUs the local Ray may schedule (default: %(default)s)")
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants:
        parser.error("give at least one variant")
    if not (0 <= args.edit_share and 0 <= args.video_share and args.edit_share + args.video_share < 1):
        parser.error("--edit-share and --video-share must be >= 0 and leave room for images")
    return args


# -- the requests ----------------------------------------------------------------------------


def workload(args: argparse.Namespace, rate: float, seed: int, duration_s: float | None = None,
             num_requests: int | None = None) -> list[ScheduledRequest]:
    """The mix at `rate`, without SLOs: images with their add-ons, edits of the templates, videos.
    Deterministic by seed."""
    images = RequestClass("image", "tiny-sd", tuple(SizeChoice(s, s) for s in (64, 96, 128)),
                          StepsChoice(choices=(20,)), weight=1.0 - args.edit_share - args.video_share,
                          guidance_scale=7.5, unique_prompts=True)
    edits = RequestClass("edit", "tiny-sd3", (SizeChoice(64, 64),), StepsChoice(choices=(8,)),
                         weight=args.edit_share, guidance_scale=7.0, unique_prompts=True)
    videos = RequestClass("video", "tiny-wan", (SizeChoice(128, 128),), StepsChoice(choices=(20,)),
                          weight=args.video_share, guidance_scale=5.0, num_frames=17)
    spec = WorkloadSpec(PoissonArrivals(rate), (images, edits, videos), duration_s=duration_s,
                        num_requests=num_requests, seed=seed, name="mixed-all-live",
                        description="tiny-sd images with add-ons, tiny-sd3 edits, tiny-wan videos")
    plain = generate(spec)
    edited = with_edits([r for r in plain if r.request_class == "edit"],
                        EditMix.trace("public", templates=TEMPLATES), seed)
    by_index = {r.index: r for r in edited}
    addons = AddonMix(("canny",), ("papercut",), (1 - args.addon_share, args.addon_share),
                      (1 - args.addon_share, args.addon_share))
    rng = random.Random(f"{seed}:addons")
    out = []
    for request in plain:
        controlnets, loras = addons.draw(rng)  # drawn for every request: the mixes differ only where they must
        if request.request_class == "image":
            request = replace(request, controlnets=controlnets, loras=loras)
        out.append(by_index.get(request.index, request))
    return out


def kind_of(request: ScheduledRequest) -> tuple:
    """What its solo latency depends on: class, size, add-ons (an edit's mask barely moves it)."""
    return request.request_class, request.width, request.height, request.controlnets, request.loras


def with_slos(requests: Sequence[ScheduledRequest], solo: Mapping[tuple, float],
              args: argparse.Namespace) -> list[ScheduledRequest]:
    """Each request with `slo_s` = its class's scale x the solo latency of its kind, sent in its body."""
    return [replace(r, slo_s=(args.video_slo if r.is_video else args.image_slo) * solo[kind_of(r)], send_slo=True)
            for r in requests]


def probes(args: argparse.Namespace, seed: int) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """A request of every kind the runs send (the solo probes), and an edit of every template
    (with the probes, the warm-up: it records the templates' activations); edits' masks at
    `SOLO_MASK`."""
    pool = workload(argparse.Namespace(**{**vars(args), "addon_share": 0.5}), 5.0, seed, num_requests=400)
    kinds: dict[tuple, ScheduledRequest] = {}
    templates: dict[str, ScheduledRequest] = {}
    for request in pool:
        if request.request_class == "edit":
            request = replace(request, mask_ratio=SOLO_MASK)
            templates.setdefault(request.template_id, request)
        kinds.setdefault(kind_of(request), request)
    return list(kinds.values()), list(templates.values())


# -- the live part ---------------------------------------------------------------------------


def measure_solo(url: str, kinds: Sequence[ScheduledRequest], repeats: int, timeout_s: float) -> dict[tuple, float]:
    """Median latency of each kind's probe alone on the idle app."""
    return {kind_of(p): statistics.median(r.latency_s for r in one_by_one(url, [p] * repeats, timeout_s))
            for p in kinds}


def run_variant(base: dict[str, Any], port: int, policy: str, args: argparse.Namespace,
                solo: dict[tuple, float] | None) -> tuple[dict[tuple, float], dict[float, list[RequestRecord]]]:
    """Deploy with `policy`, warm up, measure solo latencies when none are known yet, run every rate."""
    with deployed(bench_serve_config(base, port, policy)) as url:
        asyncio.run(wait_ready(url))
        kinds, templates = probes(args, args.seed + 1)
        one_by_one(url, templates + kinds, args.request_timeout)  # warm-up: every path, every template recorded
        if solo is None:
            solo = measure_solo(url, kinds, args.solo_repeats, args.request_timeout)
            log("solo latency: " + ", ".join(f"{'/'.join(map(str, k[:3]))}{'+cn' if k[3] else ''}"
                                             f"{'+lora' if k[4] else ''} {t:.2f} s" for k, t in solo.items()))
        records = {}
        for rate in args.rates:
            requests = with_slos(workload(args, rate, args.seed, duration_s=args.duration), solo, args)
            records[rate] = asyncio.run(run_open_loop(url, requests, args.request_timeout,
                                                      requests[-1].offset_s + args.request_timeout))
            log(f"[{policy} @ {rate:g} req/s] {format_summary(summarize(records[rate], offered_rps=rate))}; "
                + ", ".join(f"{c} {100 * (a or 0):.0f}%" for c, a in attainment_by_class(records[rate]).items()))
    return solo, records


# -- results ---------------------------------------------------------------------------------


def attainment_by_class(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """SLO attainment of each class (a refused or unanswered request is a miss)."""
    out: dict[str, float | None] = {}
    for name in CLASSES:
        mine = [r for r in records if r.request_class == name]
        out[name] = sum(1 for r in mine if r.met_slo) / len(mine) if mine else None
    return out


def build_report(setup: dict[str, Any], solo: Mapping[tuple, float],
                 records: Mapping[str, Mapping[float, Sequence[RequestRecord]]]) -> dict[str, Any]:
    return {
        **setup,
        "solo_s": [{"class": k[0], "width": k[1], "height": k[2], "controlnets": list(k[3]), "loras": list(k[4]),
                    "seconds": t} for k, t in solo.items()],
        "runs": [{"variant": variant, "rate": rate, "summary": asdict(summarize(recs, offered_rps=rate)),
                  "slo_attainment_by_class": attainment_by_class(recs), "records": [asdict(r) for r in recs]}
                 for variant, by_rate in records.items() for rate, recs in sorted(by_rate.items())],
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """One panel a rate: SLO attainment by class (and overall), one bar a variant."""
    rates = sorted({run["rate"] for run in report["runs"]})
    variants = list(dict.fromkeys(run["variant"] for run in report["runs"]))
    figure = Figure(figsize=(5.5 * len(rates), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(rates), squeeze=False)[0]
    groups = [*CLASSES, "all"]
    width = 0.8 / len(variants)
    for ax, rate in zip(axes, rates):
        for i, variant in enumerate(variants):
            run = next(r for r in report["runs"] if r["variant"] == variant and r["rate"] == rate)
            values = [*(run["slo_attainment_by_class"][c] for c in CLASSES), run["summary"]["slo_attainment"]]
            bars = ax.bar([g + (i - (len(variants) - 1) / 2) * width for g in range(len(groups))],
                          [100 * (v or 0) for v in values], width, color=f"C{i}", label=variant)
            ax.bar_label(bars, labels=[f"{100 * v:.0f}" if v is not None else "-" for v in values], fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set(ylim=(0, 110), ylabel="requests meeting their SLO (%)", title=f"{rate:g} req/s offered")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"the CPU twin, live ({report['config_path']}): images with add-ons, cached edits, videos; "
                    f"SLO {report['image_slo']:g}x / {report['video_slo']:g}x solo")
    figure.savefig(path, dpi=110)


def shown_path(path: Path) -> str:
    """A config's path as a reader of the results would type it: from the repository root if inside."""
    root = CONFIGS.parent.resolve()
    return str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = load_serve_config(args.config)
    started = time.perf_counter()
    solo: dict[tuple, float] | None = None
    records: dict[str, dict[float, list[RequestRecord]]] = {}
    port = free_port()  # one for all apps: Serve keeps the HTTP options it first started with
    with local_ray(args.num_cpus):
        for policy in args.variants:
            log(f"[{policy}] deploying, warming up, running {len(args.rates)} rate(s)...")
            solo, records[policy] = run_variant(base, port, policy, args, solo)
    setup = {"benchmark": "mixed_all_live", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "ray_num_cpus": args.num_cpus},
             "config_path": shown_path(args.config), "rates": args.rates, "duration_s": args.duration,
             "edit_share": args.edit_share, "video_share": args.video_share, "addon_share": args.addon_share,
             "image_slo": args.image_slo, "video_slo": args.video_slo, "seed": args.seed,
             "request_timeout_s": args.request_timeout, "solo_measured_on": args.variants[0]}
    report = build_report(setup, solo or {}, records)
    report["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_all_live.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "mixed_all_live.png")
    for run in report["runs"]:
        classes = ", ".join(f"{c} {100 * (a or 0):.0f}%" for c, a in run["slo_attainment_by_class"].items())
        print(f"{run['variant']:<12} @ {run['rate']:g} req/s: SLO {100 * (run['summary']['slo_attainment'] or 0):.1f}%"
              f" ({classes}), P95 {run['summary']['latency_p95_s'] or float('nan'):.2f} s")
    print(f"wrote {args.out / 'mixed_all_live.json'} and .png ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
