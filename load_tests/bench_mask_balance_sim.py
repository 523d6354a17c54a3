"""Mask-aware editing at GPU magnitude, simulated (InstGenIE §4.2, §4.4, §6.5): how a forward
loads cached activations, and where edits are placed.

1. Loading (Fig. 4-left, Fig. 9): one edit's latency at mask ratios 0.1 / 0.2 / 0.5 when its
   cached activations are loaded naively (all, then compute), always pipelined, by Algorithm 1,
   by the exact optimum of the same pipeline, and for free (ideal), for an SDXL- and a Flux-size
   model, at the bandwidth the paper's SDXL numbers imply and at `--load-gbps`.
2. Placement (Fig. 4-right, Fig. 16-right): N workers of a Flux-size model (max batch 8),
   Poisson edits at several rates with mask ratios from a trace's distribution
   (load_tests/edit_workload.py), every edit finding its template cached: P95 latency with
   `mask_aware` placement (Algorithm 2) against `continuous` (join-shortest-queue by request
   count, the paper's "ReqNum"). The paper: up to -26% P95 (Flux, H800, 0.5 req/s per worker).

Costs are DERIVED from the paper's figures (nothing was measured on a GPU), each rule in the
JSON's "derivation":

- Work: Table 1's FLOPs (edit_costs.DiTDims) of Flux.1 (57 blocks, hidden 3072, 4096 image and
  512 text tokens at 1024 px; guidance-distilled: one row; 28 steps) and of SDXL's transformer
  blocks (10 at 64x64 tokens x 640, 60 at 32x32 x 1280, 77 text tokens; CFG: two rows; 50 steps).
- Compute: a line FLOPs -> seconds (Fig. 11: linear, R^2 0.998+) through two points per model.
  Flux: an edit at mask ratio 0.2 takes 2.27 s (§3.1) and is 1.9x faster than the full forward
  (§6.3), so the full edit takes 4.31 s. SDXL (1024x768, Fig. 1's virtual try-on): the full
  edit takes 1.94 s (Fig. 1 "Standard") and mask ratio 0.2 is 2.2x faster (§6.3).
- Loading: a block's cached activations are (1 - m) L H values of 2 bytes per row (Table 1's
  cache shape); a copy costs 10 us plus bytes / bandwidth. Fig. 4-left (SDXL, H800, PCIe Gen5):
  naive 2.14 s, ideal 1.06 s, so naive loading adds 1.08 s an edit; the ideal's mask ratio
  follows from the SDXL line, and the bandwidth that makes the loads take 1.08 s is the
  "paper-implied" one (10 GB/s, a sixth of PCIe Gen5 x16's 64 GB/s peak). At it, Flux edits
  are load-bound (a 0.2 edit takes 3.2 s, not §3.1's 2.27 s): the two models' published
  numbers do not fit one bandwidth with Table 1's byte count. The placement runs use
  `--load-gbps` (default 25: copies from pageable host memory over PCIe Gen5 at about 40% of
  its peak), where the Flux numbers hold.
- The rest of a request: round overhead 1.2 ms a step and request overhead 3 ms (InstGenIE
  §6.6); text encoding 30 ms + 2 ms a text and VAE decode + PNG 200 ms (assumed: small next to
  seconds of denoising).

    python -m stepserve.load_tests.bench_mask_balance_sim --out docs/results/mask-balance-sim

Writes mask_balance.json, mask_balance.png (P95 by rate, loading by mask ratio) and
mask_balance_cdfs.png (latency CDFs per rate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stepserve.load_tests.edit_workload import EditMix, with_edits
from stepserve.load_tests.metrics import percentile
from stepserve.load_tests.plots import plot_latency_cdfs
from stepserve.load_tests.sim.services import TextEncoderSpec
from stepserve.load_tests.sim.simulator import SimConfig, SimResult, simulate
from stepserve.load_tests.workload import PoissonWorkload, generate
from stepserve.policies.cost_model import (DENOISE, REQUEST_OVERHEAD, ROUND_OVERHEAD, TEXT_ENCODE, VAE_DECODE,
                                           ProfiledCostModel, ProfileRow)
from stepserve.policies.instgenie import DiTDims, EditCostModel, LinearFit, Loading, MaskAwareCosts, fit_line
from stepserve.policies.instgenie.edit_costs import forward_flops

FLUX = "flux.1-dev"
SDXL = "stable-diffusion-xl-base-1.0"
DERIVED = "derived from InstGenIE's figures, not measured (load_tests/bench_mask_balance_sim.py)"
COPY_FIXED_S = 10e-6  # one block's copy: launch and completion event
PAPER = {
    "flux_edit_m02_s": 2.27, "flux_speedup_m02": 1.9, "flux_steps": 28, "flux_size": (1024, 1024), "flux_rows": 1,
    "sdxl_full_s": 1.94, "sdxl_speedup_m02": 2.2, "sdxl_steps": 50, "sdxl_size": (1024, 768), "sdxl_rows": 2,
    "sdxl_naive_s": 2.14, "sdxl_ideal_s": 1.06, "p95_reduction": 0.26,
}
DIMS = {
    FLUX: (DiTDims(57, 3072, patch=2, text_tokens=512),),
    SDXL: (DiTDims(10, 640, patch=2, text_tokens=77), DiTDims(60, 1280, patch=4, text_tokens=77)),
}
POLICIES = {"continuous (JSQ by requests)": ("continuous", {}),
            "mask_aware": ("mask_aware", {}),
            "mask_aware, one-step cost": ("mask_aware", {"horizon": "step"}),
            "composed": ("composed", {})}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_mask_balance_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=8, help="InstGenIE §6.2: 8 GPUs, one worker each")
    parser.add_argument("--max-batch-size", type=int, default=8, help="§6.2: 8 for SDXL and Flux")
    parser.add_argument("--rates", default="0.25,0.45,0.6,0.65,0.7", help="edits/s per worker, comma-separated")
    parser.add_argument("--duration", type=float, default=400.0, help="seconds of Poisson arrivals a run")
    parser.add_argument("--trace", default="public", help="mask ratios: instgenie | public | viton (edit_workload)")
    parser.add_argument("--load-gbps", type=float, default=25.0, help="host->GPU bandwidth of the placement runs")
    parser.add_argument("--ratios", default="0.1,0.2,0.5", help="mask ratios of the loading comparison")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _line(dims: tuple[DiTDims, ...], size: tuple[int, int], rows: int, full_s: float, speedup: float) -> LinearFit:
    """The compute line through (FLOPs at mask ratio 1, full_s) and (FLOPs at 0.2, full_s / speedup)."""
    height, width = size
    return fit_line([(forward_flops(dims, height, width, rows, 1.0), full_s),
                     (forward_flops(dims, height, width, rows, 0.2), full_s / speedup)])


def derive(load_gbps: float) -> dict[str, Any]:
    """Both models' compute lines, the paper-implied bandwidth, and how each was obtained."""
    p = PAPER
    flux_full = p["flux_edit_m02_s"] * p["flux_speedup_m02"] / p["flux_steps"]
    flux = _line(DIMS[FLUX], p["flux_size"], p["flux_rows"], flux_full, p["flux_speedup_m02"])
    sdxl = _line(DIMS[SDXL], p["sdxl_size"], p["sdxl_rows"], p["sdxl_full_s"] / p["sdxl_steps"], p["sdxl_speedup_m02"])
    # Fig. 4-left's ideal edit: the mask ratio whose cached forward takes ideal / steps (FLOPs
    # are linear in the ratio), and the bandwidth that makes naive loading add naive - ideal.
    height, width = p["sdxl_size"]
    rows, steps, dims = p["sdxl_rows"], p["sdxl_steps"], DIMS[SDXL]
    f0, f1 = (forward_flops(dims, height, width, rows, m) for m in (0.0, 1.0))
    ratio = ((p["sdxl_ideal_s"] / steps - sdxl.intercept) / sdxl.slope - f0) / (f1 - f0)
    nbytes = sum(d.blocks * d.block_bytes(d.tokens(height, width), rows, ratio) for d in dims)
    blocks = sum(d.blocks for d in dims)
    load_s = (p["sdxl_naive_s"] - p["sdxl_ideal_s"]) / steps - blocks * COPY_FIXED_S
    implied_gbps = nbytes / load_s / 1e9
    return {
        "lines": {FLUX: flux, SDXL: sdxl},
        "implied_gbps": implied_gbps,
        "report": {
            "flux": {"steps": p["flux_steps"], "size": p["flux_size"], "rows": p["flux_rows"],
                     "full_edit_s": flux_full * p["flux_steps"], "edit_m02_s": p["flux_edit_m02_s"],
                     "line_intercept_ms": flux.intercept * 1e3, "line_tflops": 1e-12 / flux.slope},
            "sdxl": {"steps": steps, "size": p["sdxl_size"], "rows": rows, "full_edit_s": p["sdxl_full_s"],
                     "line_intercept_ms": sdxl.intercept * 1e3, "line_tflops": 1e-12 / sdxl.slope,
                     "fig4_ideal_mask_ratio": ratio, "fig4_bytes_per_step": nbytes},
            "copy_fixed_us": COPY_FIXED_S * 1e6,
            "paper_implied_gbps": implied_gbps,
            "placement_gbps": load_gbps,
            "sources": "Flux: §3.1 (2.27 s at 0.2), §6.3 (1.9x at 0.2); SDXL: Fig. 1 (1.94 s standard), §6.3 "
                       "(2.2x at 0.2), Fig. 4-left (naive 2.14 s, ideal 1.06 s); overheads: §6.6; " + DERIVED,
        },
    }


def edit_model(model: str, line: LinearFit, gbps: float) -> EditCostModel:
    return EditCostModel(DIMS[model], line, LinearFit.bandwidth(gbps * 1e9, COPY_FIXED_S))


def loading_comparison(derived: dict[str, Any], ratios: list[float], load_gbps: float) -> list[dict[str, Any]]:
    """One edit's seconds by each way of loading, per model, bandwidth and mask ratio."""
    p = PAPER
    out = []
    for model, key in ((SDXL, "sdxl"), (FLUX, "flux")):
        height, width = p[f"{key}_size"]
        rows, steps = p[f"{key}_rows"], p[f"{key}_steps"]
        for label, gbps in (("paper-implied", derived["implied_gbps"]), ("assumed", load_gbps)):
            edits = edit_model(model, derived["lines"][model], gbps)
            for m in ratios:
                seconds = {loading.value: steps * edits.seconds(height, width, rows, m, loading) for loading in Loading}
                ideal = seconds[Loading.IDEAL.value]
                out.append({"model": model, "bandwidth": label, "gbps": gbps, "mask_ratio": m,
                            "seconds": seconds, "full_s": steps * edits.seconds(height, width, rows, 1.0),
                            "over_ideal": {k: v / ideal - 1 for k, v in seconds.items()}})
    return out


def flux_costs(line: LinearFit, gbps: float, max_rows: int) -> MaskAwareCosts:
    """The Flux base profile (full forwards on the line, the rest as the derivation says) with
    its edit model on top."""
    height, width = PAPER["flux_size"]

    def row(component: str, seconds: float, h: int = 0, w: int = 0, n: int = 1) -> ProfileRow:
        return ProfileRow(FLUX, "h800", component, h, w, n, 1, seconds * 1e3, 1, DERIVED)

    rows = [row(DENOISE, line(forward_flops(DIMS[FLUX], height, width, n)), height, width, n)
            for n in range(1, 2 * max_rows + 1)]
    rows += [row(TEXT_ENCODE, 0.030 + 0.002 * n, n=n) for n in (1, 2, 4, 8, 16)]
    rows += [row(VAE_DECODE, 0.200, height, width), row(ROUND_OVERHEAD, 0.0012), row(REQUEST_OVERHEAD, 0.003)]
    return MaskAwareCosts(ProfiledCostModel(rows), {FLUX: edit_model(FLUX, line, gbps)})


def sim_config(args: argparse.Namespace, policy: str, options: dict[str, Any]) -> SimConfig:
    # A GPU cluster: a VAE decoder per two workers, a text encoder per four, queues that never reject.
    return SimConfig(workers=args.workers, max_batch_size=args.max_batch_size, policy=policy, policy_options=options,
                     decoders=max(1, args.workers // 2),
                     text_encoder=TextEncoderSpec(replicas=max(1, args.workers // 4)),
                     max_queued_images=100_000)


def latencies(result: SimResult) -> list[float]:
    done = [t.latency_s for t in result.traces if t.status == "finished"]
    if len(done) != len(result.traces):
        raise RuntimeError(f"{len(result.traces) - len(done)} of {len(result.traces)} requests did not finish")
    return done


def placement_runs(args: argparse.Namespace, costs: MaskAwareCosts) -> tuple[list[dict[str, Any]], dict]:
    """P50/P95 of every policy at every rate, and the latencies for the CDF figure."""
    height, width = PAPER["flux_size"]
    mix = EditMix.trace(args.trace)
    runs, cdfs = [], {}
    for per_worker in (float(r) for r in args.rates.split(",")):
        rate = per_worker * args.workers
        requests = with_edits(generate(PoissonWorkload(
            rate=rate, duration_s=args.duration, steps_choices=(PAPER["flux_steps"],), width=width, height=height,
            guidance_scale=1.0, model=FLUX, seed=args.seed)), mix, args.seed)
        entry: dict[str, Any] = {"rate_per_worker": per_worker, "rate_rps": rate, "requests": len(requests),
                                 "policies": {}}
        panel = cdfs[f"{per_worker:g} req/s per worker"] = {}
        for label, (policy, options) in POLICIES.items():
            result = simulate(requests, costs, sim_config(args, policy, options))
            values = panel[label] = latencies(result)
            entry["policies"][label] = {
                "p50_s": percentile(values, 50), "p95_s": percentile(values, 95), "p99_s": percentile(values, 99),
                "mean_s": sum(values) / len(values), "busy_fraction": result.summary().busy_fraction,
                "decision_ms_mean": 1e3 * result.plan_wall_s / max(1, result.decisions)}
        base = entry["policies"]["continuous (JSQ by requests)"]["p95_s"]
        entry["p95_change"] = {label: run["p95_s"] / base - 1 for label, run in entry["policies"].items()
                               if label != "continuous (JSQ by requests)"}
        runs.append(entry)
    return runs, cdfs


def plot(report: dict[str, Any], path: Path) -> None:
    """P95 (solid) and P50 (dashed) by rate per policy; one edit's latency by loading method."""
    figure = Figure(figsize=(14, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    tails, sdxl, flux = figure.subplots(1, 3, width_ratios=(1.3, 1, 1))
    runs = report["placement"]
    rates = [r["rate_per_worker"] for r in runs]
    for i, label in enumerate(runs[0]["policies"]):
        tails.plot(rates, [r["policies"][label]["p95_s"] for r in runs], "o-", color=f"C{i}", label=f"{label} P95")
        tails.plot(rates, [r["policies"][label]["p50_s"] for r in runs], "x--", color=f"C{i}", alpha=0.6,
                   label=f"{label} P50")
    tails.set(xlabel="edits / s per worker", ylabel="latency (s)",
              title=f"{report['workers']} Flux workers, {report['trace']} trace masks")
    tails.legend(fontsize=7)
    # SDXL where the paper's naive loading adds 102%; Flux as the placement runs load.
    for ax, model, name, bandwidth in ((sdxl, SDXL, "SDXL", "paper-implied"), (flux, FLUX, "Flux", "assumed")):
        rows = [r for r in report["loading"] if r["model"] == model and r["bandwidth"] == bandwidth]
        methods = [m.value for m in Loading]
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            ax.bar([i + j * width for i in range(len(rows))], [r["seconds"][method] for r in rows], width,
                   color=f"C{j}", label=method)
        ax.axhline(rows[0]["full_s"], color="grey", linestyle=":", label="no cache (full)")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"m = {r['mask_ratio']:g}" for r in rows])
        ax.set(ylabel="one edit (s)", title=f"{name} edit, loading at {rows[0]['gbps']:.0f} GB/s ({bandwidth})")
        ax.legend(fontsize=7)
    for ax in (tails, sdxl, flux):
        ax.grid(alpha=0.3)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    derived = derive(args.load_gbps)
    ratios = [float(m) for m in args.ratios.split(",")]
    costs = flux_costs(derived["lines"][FLUX], args.load_gbps, args.max_batch_size)
    runs, cdfs = placement_runs(args, costs)
    report = {"benchmark": "mask_balance_sim", "workers": args.workers, "max_batch_size": args.max_batch_size,
              "trace": args.trace, "duration_s": args.duration, "seed": args.seed, "model": FLUX,
              "derivation": derived["report"], "loading": loading_comparison(derived, ratios, args.load_gbps),
              "placement": runs, "paper": {"p95_reduction": PAPER["p95_reduction"],
                                           "naive_over_ideal_sdxl": PAPER["sdxl_naive_s"] / PAPER["sdxl_ideal_s"] - 1}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mask_balance.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "mask_balance.png")
    plot_latency_cdfs(cdfs, f"edit latency, {args.workers} Flux workers", args.out / "mask_balance_cdfs.png")
    for row in report["loading"]:
        over = row["over_ideal"]
        print(f"{row['model']} at {row['gbps']:.1f} GB/s ({row['bandwidth']}), m = {row['mask_ratio']:g}: ideal "
              f"{row['seconds']['ideal']:.2f} s; naive +{over['naive']:.0%}, always-load +{over['always_load']:.0%}, "
              f"Algorithm 1 +{over['algorithm1']:.0%}, optimal +{over['optimal']:.0%}; no cache {row['full_s']:.2f} s")
    for run in runs:
        print(f"{run['rate_per_worker']:g} req/s per worker: " + "; ".join(
            f"{label} P95 {p['p95_s']:.2f} s" for label, p in run["policies"].items())
              + "; P95 vs JSQ: " + ", ".join(f"{k} {v:+.0%}" for k, v in run["p95_change"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
