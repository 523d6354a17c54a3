"""Everything the cluster serves, at once, simulated at GPU magnitude: the composed policy against
each single-mechanism policy and static FCFS (issue 36's mixed workload).

The mix, on one pool of workers (every worker holds every model):

- SDXL images at 512, 768 and 1024 px in equal shares (PatchedServe §8), 50 steps with CFG, each
  with the add-ons of SwiftDiffusion's service A (Table 1: one or two ControlNets of three, run by
  the ControlNet service; LoRAs from a long-tailed catalog of 50);
- SDXL edits (a share of the image requests turned into edits): mask ratios after InstGenIE's
  public trace, most of them of a cached template (they compute their masked tokens only);
- Wan2.2-5B videos, 81 frames at 256/480/768 px (1:2:4, GenServe's skewed setting), 50 steps.

SLOs are `--image-slo` x the solo latency for images and edits (an edit's solo latency is its full
forward's: the SLO a client would set without knowing the cache) and `--video-slo` x for videos.

Costs: SDXL rows from `sdxl-h800` (DERIVED from SwiftDiffusion's figures, with add-on rows), the
SDXL edit cost model DERIVED from InstGenIE's figures (`bench_mask_balance_sim.derive`), Wan rows
from `genserve-rtx6000` (DERIVED from GenServe's figures, an RTX Pro 6000: the one video profile
shipped; on an H800 videos would run faster). Nothing here was measured on a GPU.

Goodput at 90% SLO attainment as `bench_mixed_res_sim` computes it (discarded requests count as
misses), overall and SLO attainment per class at every rate.

    python -m stepserve.load_tests.bench_mixed_all_sim --out docs/results/mixed-all-sim

Writes mixed_all.json and mixed_all.png (SLO attainment, goodput and P95 against load).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from stepserve.load_tests.addon_mix import AddonMix
from stepserve.load_tests.bench_mask_balance_sim import SDXL, derive, edit_model
from stepserve.load_tests.bench_mixed_res_sim import goodput_at
from stepserve.load_tests.edit_workload import EditMix, ScheduledEdit, with_edits
from stepserve.load_tests.metrics import Summary, summarize
from stepserve.load_tests.plots import plot_load_sweep
from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.sweep import format_summary, parse_rates
from stepserve.load_tests.workload import (PoissonArrivals, RequestClass, ScheduledRequest, SizeChoice, StepsChoice,
                                           WorkloadSpec, generate)
from stepserve.policies.addon_costs import ControlNetPlacement
from stepserve.policies.cost_model import ProfiledCostModel, read_profile, resolve_profile
from stepserve.policies.instgenie import MaskAwareCosts

WAN = "wan2.2-5b"
CONTROLNETS = ("canny", "depth", "openpose")
LORAS = tuple(f"lora-{i}" for i in range(50))
ROWS = (  # label, policy, options
    ("static_fcfs", "static_fcfs", {}),
    ("continuous", "continuous", {}),
    ("mask_aware", "mask_aware", {}),
    ("patchedserve", "patchedserve", {}),
    ("genserve", "genserve", {}),
    ("composed", "composed", {}),
)
CLASSES = ("image", "edit", "video")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_mixed_all_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNG files")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,3,4,5"),
                        help="offered req/s (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=800, help="requests a run")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--video-share", type=float, default=0.05, help="share of requests that are videos")
    parser.add_argument("--edit-share", type=float, default=0.3, help="share of image requests that are edits")
    parser.add_argument("--image-slo", type=float, default=5.0, help="images' and edits' SLO, x solo latency")
    parser.add_argument("--video-slo", type=float, default=2.0, help="videos' SLO, x solo latency at SP 1")
    parser.add_argument("--load-gbps", type=float, default=25.0, help="host-to-device bandwidth of edit loads")
    parser.add_argument("--policies", default=",".join(label for label, *_ in ROWS),
                        help="rows to run, comma-separated (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def costs(load_gbps: float) -> MaskAwareCosts:
    rows = [*read_profile(resolve_profile("sdxl-h800")),
            *(r for r in read_profile(resolve_profile("genserve-rtx6000")) if r.model == WAN)]
    base = ProfiledCostModel(rows, ControlNetPlacement.SERVICE)
    line = derive(load_gbps)["lines"][SDXL]
    return MaskAwareCosts(base, {SDXL: edit_model(SDXL, line, load_gbps)})


def workload(args: argparse.Namespace, rate: float) -> WorkloadSpec:
    images = RequestClass("image", SDXL, tuple(SizeChoice(s, s) for s in (512, 768, 1024)),
                          StepsChoice(choices=(50,)), weight=1.0 - args.video_share, guidance_scale=7.5,
                          unique_prompts=True, slo_scale=args.image_slo)
    skewed = (SizeChoice(256, 256, 1.0), SizeChoice(480, 480, 2.0), SizeChoice(768, 768, 4.0))
    videos = RequestClass("video", WAN, skewed, StepsChoice(choices=(50,)), weight=args.video_share,
                          guidance_scale=5.0, slo_scale=args.video_slo, num_frames=81)
    return WorkloadSpec(PoissonArrivals(rate), (images, videos), num_requests=args.requests,
                        slo_scale=args.image_slo, seed=args.seed, name="mixed-all",
                        description="SDXL images with add-ons, SDXL edits, Wan videos")


def requests_at(args: argparse.Namespace, rate: float, pricing: MaskAwareCosts) -> list[ScheduledRequest]:
    """The mix at `rate`: edits drawn first (an edit carries no add-ons), then every other image's
    add-ons; deterministic by seed."""
    plain = generate(workload(args, rate), pricing)
    edits = with_edits(plain, replace(EditMix.trace("public"), share=args.edit_share), args.seed)
    addons, rng = AddonMix.service("A", CONTROLNETS, LORAS), random.Random(f"{args.seed}:addons")
    out = []
    for request in edits:
        controlnets, loras = addons.draw(rng)  # drawn for every request: the mixes differ only where they must
        plain_image = not request.is_video and not isinstance(request, ScheduledEdit)
        out.append(replace(request, controlnets=controlnets, loras=loras) if plain_image else request)
    return out


def kind_of(request: ScheduledRequest) -> str:
    return "video" if request.is_video else "edit" if isinstance(request, ScheduledEdit) else "image"


def sim_config(args: argparse.Namespace, policy: str, options: dict[str, Any]) -> SimConfig:
    # A GPU cluster: a VAE decoder per worker, a text encoder per four, queues that never reject.
    return SimConfig(workers=args.workers, max_batch_size=args.max_batch_size, policy=policy, policy_options=options,
                     decoders=args.workers, text_encoder=TextEncoderSpec(replicas=max(1, args.workers // 4)),
                     max_queued_images=1_000_000, max_queued_videos=1_000_000)


def run(args: argparse.Namespace) -> dict[str, Any]:
    pricing = costs(args.load_gbps)
    chosen = [row for row in ROWS if row[0] in args.policies.split(",")]
    sweeps: dict[str, list[tuple[float, Summary]]] = {label: [] for label, *_ in chosen}
    runs: list[dict[str, Any]] = []
    for rate in args.rates:
        requests = requests_at(args, rate, pricing)
        kinds = [kind_of(r) for r in requests]  # by position: a record's `index`
        for label, policy, options in chosen:
            result = simulate(requests, pricing, sim_config(args, policy, options))
            records = result.records()
            summary = summarize(records, result.busy_s, rate)
            sweeps[label].append((rate, summary))
            per_class = {}
            for name in CLASSES:
                mine = [r for r in records if kinds[r.index] == name]
                per_class[name] = {"requests": len(mine), "slo_attainment": (
                    sum(1 for r in mine if r.met_slo) / len(mine) if mine else None)}
            print(f"[{label} @ {rate:g} req/s] {format_summary(summary)}; "
                  + ", ".join(f"{k} {100 * (v['slo_attainment'] or 0):.0f}%" for k, v in per_class.items())
                  + f" ({result.wall_s:.1f} s wall)", file=sys.stderr, flush=True)
            runs.append({"policy": label, "rate": rate, "summary": asdict(summary), "classes": per_class,
                         "discarded": sum(1 for t in result.traces if t.status == "failed"),
                         "decision_ms_mean": 1e3 * result.plan_wall_s / max(1, result.decisions),
                         "wall_s": result.wall_s})
    goodput = {label: goodput_at([(r, s.slo_attainment or 0.0) for r, s in points]) for label, points in sweeps.items()}
    singles = [g["rps"] for label, g in goodput.items() if label not in ("composed", "static_fcfs") and g["rps"]]
    best = max(singles, default=None)
    if "composed" in goodput:
        composed = goodput["composed"]["rps"]
        goodput["composed"]["vs_best_single"] = None if not best or composed is None else composed / best
    title = (f"SDXL images + add-ons, SDXL edits, Wan videos on {args.workers} workers (derived profiles); "
             f"SLO {args.image_slo:g}x / {args.video_slo:g}x solo")
    plot_load_sweep(sweeps, title, args.out / "mixed_all.png")
    return {"goodput_at_90": goodput, "best_single_rps": best, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "mixed_all_sim", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workers": args.workers, "max_batch_size": args.max_batch_size, "requests": args.requests, "seed": args.seed,
        "rates": args.rates, "video_share": args.video_share, "edit_share": args.edit_share,
        "image_slo": args.image_slo, "video_slo": args.video_slo, "load_gbps": args.load_gbps,
        "costs": "DERIVED, not measured: sdxl-h800 (SDXL, add-ons), InstGenIE-derived SDXL edit model, "
                 "genserve-rtx6000 (Wan2.2-5B, an RTX Pro 6000)",
        **run(args),
    }
    report["wall_s"] = time.perf_counter() - started
    (args.out / "mixed_all.json").write_text(json.dumps(report, indent=1))
    print(f"SLO attainment by rate {', '.join(f'{r:g}' for r in args.rates)} req/s ({args.workers} workers)")
    for label, good in report["goodput_at_90"].items():
        cells = [f"{100 * run['summary']['slo_attainment']:5.1f}%" for run in report["runs"] if run["policy"] == label]
        value = "-" if good["rps"] is None else f"{'>= ' if good['at_least'] else ''}{good['rps']:.2f}"
        vs = good.get("vs_best_single")
        ratio = f" ({vs:.2f}x the best single-mechanism policy)" if vs else ""
        print(f"  {label:<14} {' '.join(cells)}   goodput@90%: {value} req/s{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
