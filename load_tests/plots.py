"""PNG figures of benchmark results, drawn with matplotlib's Agg canvas.

Figures are built with the object API on their own Agg canvas, not pyplot, so no global
backend or figure registry is touched and nothing needs a display.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from stepserve.load_tests.metrics import Summary
from stepserve.load_tests.records import RequestRecord


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_batching(records: Mapping[str, Sequence[RequestRecord]], summaries: Mapping[str, Summary],
                  offered_rps: float, title: str, path: Path) -> None:
    """Latency CDF per policy, P50/P95 bars, and throughput against the offered rate."""
    figure = _figure(15, 4.5)
    cdf, tails, rates = figure.subplots(1, 3, width_ratios=(2, 1.2, 1))
    figure.suptitle(title)
    policies = list(records)
    colors = {p: f"C{i}" for i, p in enumerate(policies)}

    for policy in policies:
        latencies = sorted(r.latency_s for r in records[policy] if r.ok)
        if not latencies:
            continue
        fractions = [(i + 1) / len(latencies) for i in range(len(latencies))]
        cdf.step(latencies, fractions, where="post", color=colors[policy], label=policy)
        cdf.axvline(summaries[policy].latency_p95_s, color=colors[policy], linestyle="--", linewidth=0.8)
    cdf.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
    cdf.set(xlabel="latency (s, from scheduled send)", ylabel="fraction of successful requests",
            title="latency CDF (dashed: P95)", ylim=(0, 1.02))
    cdf.grid(alpha=0.3)
    cdf.legend(loc="lower right")

    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        s = summaries[policy]
        values = [s.latency_p50_s or 0.0, s.latency_p95_s or 0.0]
        bars = tails.bar([x + i * width for x in (0, 1)], values, width, color=colors[policy], label=policy)
        tails.bar_label(bars, fmt="%.2f", fontsize=8)
    tails.set_xticks([x + width * (len(policies) - 1) / 2 for x in (0, 1)], ["P50", "P95"])
    tails.set(ylabel="latency (s)", title="latency percentiles")
    tails.legend()

    bars = rates.bar(policies, [summaries[p].throughput_rps for p in policies],
                     color=[colors[p] for p in policies])
    rates.bar_label(bars, fmt="%.2f", fontsize=8)
    rates.axhline(offered_rps, color="grey", linestyle="--", linewidth=0.8, label=f"offered {offered_rps:g}/s")
    rates.set(ylabel="completed requests / s", title="throughput")
    rates.legend(loc="lower right")
    figure.savefig(path, dpi=110)


def plot_overhead(panels: Mapping[str, Sequence[Mapping]], path: Path) -> None:
    """One panel per level (engine, live): median latency of stepserve vs diffusers per case,
    every repeat as a dot, the ratio over each pair of bars.

    Each row of a panel has `label`, `stepserve_s` and `diffusers_s` (lists of repeats),
    their medians and `ratio`.
    """
    figure = _figure(6 * len(panels), 4.5)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (level, rows) in zip(axes, panels.items()):
        for offset, key, color in ((-0.2, "stepserve", "C0"), (0.2, "diffusers", "C1")):
            xs = [i + offset for i in range(len(rows))]
            ax.bar(xs, [row[f"{key}_median_s"] for row in rows], 0.4, color=color, alpha=0.7, label=key)
            for x, row in zip(xs, rows):
                ax.scatter([x] * len(row[f"{key}_s"]), row[f"{key}_s"], color="black", s=6, zorder=3)
        for i, row in enumerate(rows):
            top = max(row["stepserve_median_s"], row["diffusers_median_s"])
            ax.annotate(f"{row['ratio']:.2f}x", (i, top), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=9)
        ax.set_xticks(range(len(rows)), [row["label"] for row in rows])
        ax.set(ylabel="solo request latency (s)", title=f"{level}: stepserve / diffusers (median)")
        ax.legend(loc="upper left")
    figure.savefig(path, dpi=110)


# -- load sweeps (simulated or live): one implementation for both ----------------------------


def _cdf(ax, latencies: Sequence[float], label: str, color: str) -> None:
    values = sorted(latencies)
    if not values:
        return
    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=color, label=label)


def plot_latency_cdfs(panels: Mapping[str, Mapping[str, Sequence[float]]], title: str, path: Path) -> None:
    """One panel per key (e.g. per offered rate), one CDF per label (e.g. per policy) in it."""
    figure = _figure(min(5.0 * len(panels), 20.0), 4.2)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    figure.suptitle(title)
    labels = list(dict.fromkeys(label for curves in panels.values() for label in curves))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    for ax, (name, curves) in zip(axes, panels.items()):
        for label, latencies in curves.items():
            _cdf(ax, latencies, label, colors[label])
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.set(xlabel="latency (s)", ylabel="fraction of completed requests", title=name, ylim=(0, 1.02))
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    figure.savefig(path, dpi=110)


def plot_load_sweep(sweeps: Mapping[str, Sequence[tuple[float, Summary]]], title: str, path: Path) -> None:
    """Against offered load, one line per policy: SLO attainment, goodput (throughput dashed)
    and P95 latency."""
    figure = _figure(15, 4.5)
    slo, good, tail = figure.subplots(1, 3)
    figure.suptitle(title)
    top = 0.0
    for i, (label, points) in enumerate(sweeps.items()):
        points = sorted(points, key=lambda p: p[0])
        rates = [rate for rate, _ in points]
        color = f"C{i}"
        attainment = [s.slo_attainment for _, s in points]
        if any(a is not None for a in attainment):
            slo.plot(rates, [100 * (a or 0.0) for a in attainment], "o-", color=color, label=label)
        goodput = [s.goodput_rps for _, s in points]
        if any(g is not None for g in goodput):
            good.plot(rates, [g or 0.0 for g in goodput], "o-", color=color, label=f"{label} goodput")
        good.plot(rates, [s.throughput_rps for _, s in points], "x--", color=color, alpha=0.6,
                  label=f"{label} throughput")
        tail.plot(rates, [s.latency_p95_s or float("nan") for _, s in points], "o-", color=color, label=label)
        top = max([top] + rates)
    slo.axhline(90, color="grey", linestyle=":", linewidth=0.8)
    slo.set(xlabel="offered load (req/s)", ylabel="requests meeting their SLO (%)", title="SLO attainment",
            ylim=(0, 102))
    good.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=0.8, label="offered")
    good.set(xlabel="offered load (req/s)", ylabel="requests / s", title="goodput (solid) and throughput (dashed)")
    tail.set(xlabel="offered load (req/s)", ylabel="P95 latency (s)", title="P95 latency")
    tail.set_yscale("log")
    for ax in (slo, good, tail):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def plot_policy_bars(sweeps: Mapping[str, Sequence[tuple[float, Summary]]], title: str, path: Path) -> None:
    """Policies side by side at each offered rate: SLO attainment, goodput and P95 latency."""
    figure = _figure(15, 4.5)
    axes = figure.subplots(1, 3)
    figure.suptitle(title)
    policies = list(sweeps)
    rates = sorted({rate for points in sweeps.values() for rate, _ in points})
    width = 0.8 / max(1, len(policies))
    metrics = (
        ("SLO attainment (%)", lambda s: 100 * (s.slo_attainment or 0.0), "%.0f"),
        ("goodput (req/s)", lambda s: s.goodput_rps or 0.0, "%.2f"),
        ("P95 latency (s)", lambda s: s.latency_p95_s or 0.0, "%.1f"),
    )
    for ax, (name, value, fmt) in zip(axes, metrics):
        for i, policy in enumerate(policies):
            by_rate = dict(sweeps[policy])
            xs = [j + i * width for j, rate in enumerate(rates) if rate in by_rate]
            bars = ax.bar(xs, [value(by_rate[rate]) for rate in rates if rate in by_rate], width,
                          color=f"C{i}", label=policy)
            if len(rates) * len(policies) <= 12:
                ax.bar_label(bars, fmt=fmt, fontsize=7)
        ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(rates))], [f"{r:g}" for r in rates])
        ax.set(xlabel="offered load (req/s)", title=name)
        ax.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def plot_sim_vs_live(panels: Mapping[str, Mapping[str, Sequence[float]]],
                     errors: Sequence[tuple[str, float | None, float | None]], tolerance: float, title: str,
                     path: Path) -> None:
    """Live and simulated latency CDFs per run, then each run's P50 and P95 error with the
    agreement band."""
    figure = _figure(min(5.0 * (len(panels) + 1), 24.0), 4.2)
    axes = figure.subplots(1, len(panels) + 1, squeeze=False)[0]
    figure.suptitle(title)
    for ax, (name, curves) in zip(axes, panels.items()):
        for i, (label, latencies) in enumerate(curves.items()):
            _cdf(ax, latencies, label, f"C{i}")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.set(xlabel="latency (s)", ylabel="fraction of completed requests", title=name, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    ax = axes[-1]
    names = [name for name, _, _ in errors]
    xs = range(len(names))
    for offset, index, label in ((-0.2, 1, "P50"), (0.2, 2, "P95")):
        ax.bar([x + offset for x in xs], [100 * (e[index] or 0.0) for e in errors], width=0.4, label=label)
    ax.axhspan(-100 * tolerance, 100 * tolerance, color="green", alpha=0.1, label=f"±{tolerance:.0%}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax.set(ylabel="simulated / live - 1 (%)", title="simulator error")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    figure.savefig(path, dpi=110)


def plot_ablation(table: Mapping[float, Mapping[str, Mapping[str, float]]], title: str, path: Path) -> None:
    """One panel per rate: overall / image / video SLO attainment per ablation row, and the
    mean image queue wait on a second axis."""
    rates = list(table)
    fig = _figure(5.2 * len(rates), 4.2)
    metrics = (("slo_overall", "overall"), ("slo_image", "image"), ("slo_video", "video"))
    for i, rate in enumerate(rates):
        ax = fig.add_subplot(1, len(rates), i + 1)
        rows = list(table[rate])
        width = 0.8 / len(metrics)
        for j, (key, label) in enumerate(metrics):
            xs = [k + (j - 1) * width for k in range(len(rows))]
            ax.bar(xs, [100 * table[rate][r][key] for r in rows], width, label=label)
        ax.set_xticks(range(len(rows)), rows)
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_ylim(0, 100)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title(f"{rate * 60:g} req/min")
        wait = ax.twinx()
        wait.plot(range(len(rows)), [table[rate][r]["image_wait_mean_s"] for r in rows], "k.--",
                  label="mean image wait (s)")
        wait.set_ylabel("mean image wait (s)")
        if i == 0:
            ax.legend(loc="upper left", fontsize=8)
            wait.legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def plot_pause_resume(rows: Sequence[Mapping], title: str, path: Path) -> None:
    """Pause, resume and the pickle round trip as % of one step, per video shape."""
    fig = _figure(6.0, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{r['height']}x{r['width']}x{r['frames']}" for r in rows]
    keys = (("pause_pct_of_step", "pause (export to host)"), ("resume_pct_of_step", "resume (import)"),
            ("pickle_pct_of_step", "pickle round trip"))
    width = 0.8 / len(keys)
    for j, (key, label) in enumerate(keys):
        ax.bar([k + (j - 1) * width for k in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("% of one denoising step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_router_scaling(points: Sequence[Mapping], title: str, path: Path) -> None:
    """Against the number of workers (log-log): the simulation's wall seconds and the router's
    decision seconds per simulated request. Each point has `workers`, `wall_s_per_request` and
    `decision_s_per_request`."""
    figure = _figure(6.5, 4.5)
    ax = figure.add_subplot(1, 1, 1)
    workers = [p["workers"] for p in points]
    # Wall labels above their points, decision labels below: the two lines run close.
    for key, label, style, dy in (("wall_s_per_request", "simulation wall", "o-", 6),
                                  ("decision_s_per_request", "of which router decisions", "s--", -12)):
        values = [p[key] for p in points]
        ax.plot(workers, values, style, label=label)
        for w, v in zip(workers, values):
            ax.annotate(f"{1e3 * v:.2g} ms", (w, v), textcoords="offset points", xytext=(4, dy), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set(xlabel="workers (same offered load per worker)", ylabel="seconds per simulated request", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    figure.savefig(path, dpi=110)


def plot_overload(runs: Sequence[Mapping], title: str, path: Path) -> None:
    """Per admission setting: what happened to each request over time (admitted and met its
    SLO, admitted and late, rejected), and the rejection latency CDF."""
    fig = _figure(6.0 * len(runs) + 5.0, 4.2)
    for i, run in enumerate(runs):
        ax = fig.add_subplot(1, len(runs) + 1, i + 1)
        records = run["records"]
        groups = {"rejected (429/503)": [], "admitted, late or failed": [], "admitted, met SLO": []}
        for r in records:
            if r["status"] in (429, 503):
                key = "rejected (429/503)"
            elif r["status"] == 200 and r["slo_s"] is not None and r["latency_s"] is not None \
                    and r["latency_s"] <= r["slo_s"]:
                key = "admitted, met SLO"
            else:
                key = "admitted, late or failed"
            groups[key].append(r["scheduled_s"])
        ax.hist(list(groups.values()), bins=30, stacked=True, label=list(groups))
        ax.set_xlabel("send time (s)")
        ax.set_ylabel("requests")
        ax.set_title(f"{run['label']}: {run['offered_rps']:.1f} req/s offered, capacity {run['capacity_rps']:.1f}",
                     fontsize=9)
        ax.legend(fontsize=7)
    ax = fig.add_subplot(1, len(runs) + 1, len(runs) + 1)
    for run in runs:
        rejections = [1000 * r["latency_s"] for r in run["records"]
                      if r["status"] in (429, 503) and r["latency_s"] is not None]
        if rejections:
            _cdf(ax, rejections, run["label"], None)
    ax.set_xlabel("rejection latency (ms)")
    ax.set_ylabel("share of rejections")
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def plot_peers(systems: Sequence[Mapping], title: str, path: Path) -> None:
    """Against offered load, one colour per system, every repeat a dot and the median a line:
    P50 and P95 latency, SLO attainment, server CPU per request."""
    figure = _figure(18, 4.5)
    axes = figure.subplots(1, 4)
    figure.suptitle(title)
    panels = (("latency_p50_s", 1000, "P50 latency (ms)"), ("latency_p95_s", 1000, "P95 latency (ms)"),
              ("slo_attainment", 100, "requests meeting their SLO (%)"),
              ("cpu_per_request_s", 1000, "server CPU per request (ms)"))
    for i, system in enumerate(systems):
        color = f"C{i}"
        for ax, (key, scale, label) in zip(axes, panels):
            dots = [(p["rate"], p[key] * scale) for p in system["points"] if p[key] is not None]
            ax.plot([r for r, _ in dots], [v for _, v in dots], ".", color=color, alpha=0.5)
            line = sorted((r, v * scale) for r, v in system[f"median_{key}"].items() if v is not None)
            ax.plot([r for r, _ in line], [v for _, v in line], "-", color=color, label=system["system"])
            ax.set(xlabel="offered load (req/s)", ylabel=label)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].axhline(90, color="grey", linestyle=":", linewidth=0.8)
    axes[2].set_ylim(0, 102)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def plot_lora_bound(result: Mapping, title: str, path: Path) -> None:
    """Left: cosine similarity of the latents with and without the LoRA per step (one line per
    seed) and the threshold's bound; right: PSNR and SSIM of the image vs exact by join step."""
    fig = _figure(11, 4)
    sims, fidelity = fig.subplots(1, 2)
    ssim_axis = fidelity.twinx()
    fig.suptitle(title)
    for i, seed in enumerate(result["seeds"]):
        color = f"C{i}"
        sims.plot(range(len(seed["similarity"])), seed["similarity"], color=color, label=f"seed {seed['seed']}")
        sims.axvline(seed["bound_step"], color=color, linestyle=":", linewidth=0.8)
        finite = [f for f in seed["fidelity"] if f["join_step"] > 0]
        fidelity.plot([f["join_step"] for f in finite], [f["psnr_db"] for f in finite], "o-", color=color)
        ssim_axis.plot([f["join_step"] for f in finite], [f["ssim"] for f in finite], "s--", color=color, alpha=0.6)
    sims.set_xlabel("denoising step")
    sims.set_ylabel("cosine similarity (with vs without LoRA)")
    sims.legend(fontsize=8)
    fidelity.set_xlabel("step the LoRA joins at")
    fidelity.set_ylabel("PSNR vs exact, dB (o-)")
    ssim_axis.set_ylabel("SSIM vs exact (s--)")
    fig.savefig(path, dpi=110)


def plot_addons(runs: Mapping[str, Sequence[Mapping]], overhead: Sequence[Mapping], title: str, path: Path) -> None:
    """Left: latency CDF per system (all repeats); right: P50 and P95 per system, with the LoRAs'
    paired overhead in the title of the panel."""
    fig = _figure(12, 4.2)
    cdf, bars = fig.subplots(1, 2, width_ratios=(1.6, 1))
    fig.suptitle(title)
    names = list(runs)
    for i, name in enumerate(names):
        latencies = sorted(x for run in runs[name] for x in run["latencies"] if x is not None)
        if latencies:
            cdf.step(latencies, [(k + 1) / len(latencies) for k in range(len(latencies))], where="post",
                     color=f"C{i}", label=name)
    cdf.set_xlabel("latency, s")
    cdf.set_ylabel("fraction of requests")
    cdf.legend(fontsize=8)
    width = 0.38
    for j, (key, label) in enumerate((("latency_p50_s", "P50"), ("latency_p95_s", "P95"))):
        values = [statistics.median(r["summary"][key] for r in runs[name] if r["summary"][key] is not None)
                  for name in names]
        bars.bar([k + (j - 0.5) * width for k in range(len(names))], values, width, label=label)
    bars.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    bars.set_ylabel("seconds (median over repeats)")
    measured = [r["lora_loading_share"] for r in runs.get("stepserve", ()) if r.get("lora_loading_share") is not None]
    shares = [o["applying"]["mean_fraction"] for o in overhead if o["applying"].get("requests")]
    if measured and shares:
        bars.set_title(f"LoRA loading (measured by stepserve): {statistics.median(measured):.1%} of all latency\n"
                       f"applying LoRAs (paired runs): {statistics.median(shares):.1%} of a LoRA request's", fontsize=8)
    bars.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_controlnet_parallel(report: Mapping, path: Path) -> None:
    """Speed-up of one request's step over running its ControlNets before the UNet, by number of
    ControlNets: each transport's, and the ideal (free communication)."""
    fig = _figure(7, 4)
    ax = fig.add_subplot(1, 1, 1)
    results = report["results"]
    counts = sorted({r["controlnets"] for r in results})
    transports = list(dict.fromkeys(r["transport"] for r in results))
    width = 0.8 / (len(transports) + 1)
    ideal = [next(r["ideal_speedup"] for r in results if r["controlnets"] == m) for m in counts]
    ax.bar([i - 0.4 + width / 2 for i in range(len(counts))], ideal, width, color="0.7", label="ideal")
    for j, name in enumerate(transports):
        values = [next(r["speedup"] for r in results if r["controlnets"] == m and r["transport"] == name)
                  for m in counts]
        ax.bar([i - 0.4 + width * (j + 1.5) for i in range(len(counts))], values, width, label=name)
    for m, (achieved, paper_ideal) in report["paper"].items():
        i = counts.index(int(m))
        ax.plot([i - 0.4, i + 0.4], [achieved, achieved], "k--", linewidth=0.8)
    ax.set_xticks(range(len(counts)), [f"{m} ControlNet{'s' * (m > 1)}" for m in counts])
    ax.set_ylabel("step speed-up over sequential")
    ax.set_title(f"{report['family']} {report['size']}px, {report['profile']} (dashed: SwiftDiffusion's achieved)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_stale_controlnet(summary: Sequence[Mapping], title: str, path: Path) -> None:
    """PSNR and SSIM against exact of one-step-stale ControlNets, and of no ControlNets at all."""
    fig = _figure(9, 3.8)
    left, right = fig.subplots(1, 2)
    fig.suptitle(title)
    labels = [f"{s['controlnets']} CN, {s['steps']} steps" for s in summary]
    width = 0.38
    for ax, metric, unit in ((left, "psnr_db", "PSNR vs exact, dB"), (right, "ssim", "SSIM vs exact")):
        for j, (prefix, label) in enumerate((("stale", "one step stale"), ("no_controlnet", "no ControlNets"))):
            ax.bar([k + (j - 0.5) * width for k in range(len(summary))], [s[f"{prefix}_{metric}"] for s in summary],
                   width, label=label)
        ax.set_xticks(range(len(summary)), labels, rotation=15, fontsize=8)
        ax.set_ylabel(unit)
    left.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_addons_sim(report: Mapping, path: Path) -> None:
    """Left: each placement's step speed-up over running ControlNets inline, light and heavy load,
    beside the ideal and the paper's; middle: throughput with mixed-LoRA forwards against one
    adapter set a forward; right: their latency in a Poisson run."""
    fig = _figure(15, 4.2)
    speed, rate, latency = fig.subplots(1, 3, width_ratios=(1.4, 1, 1))
    fig.suptitle(f"{report['model']} {report['size']}px on {report['workers']} workers ({report['profile']}), "
                 f"simulated", fontsize=10)
    entries = report["controlnets"]
    bars = [("ideal", lambda e: e["ideal_speedup"], "0.7"), ("paper", lambda e: e["paper"]["achieved"], "0.4")]
    for load in ("light", "heavy"):
        for name in ("service", "stale"):
            bars.append((f"{name}, {load}", lambda e, load=load, name=name: e["loads"][load]["runs"][name][
                "step_speedup"], None))
    width = 0.8 / len(bars)
    for j, (label, value, color) in enumerate(bars):
        speed.bar([i - 0.4 + width * (j + 0.5) for i in range(len(entries))], [value(e) for e in entries], width,
                  label=label, color=color)
    speed.set_xticks(range(len(entries)), [f"{e['controlnets']} ControlNet{'s' * (e['controlnets'] > 1)}"
                                           for e in entries])
    speed.set_ylabel("denoising step speed-up over inline")
    speed.legend(fontsize=7)
    services = report["loras"]
    modes = list(services[0]["runs"]) if services else []
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(services))]
        rate.bar(xs, [s["runs"][mode]["images_per_gpu_minute"] for s in services], width, label=mode)
        for k, quantile in enumerate(("latency_p50_s", "latency_p95_s")):
            latency.bar([x + (k - 0.5) * width / 2 for x in xs], [s["runs"][mode]["steady"][quantile] for s in services],
                        width / 2, color=f"C{j}", alpha=1.0 if k == 0 else 0.5,
                        label=f"{mode} {'P50' if k == 0 else 'P95'}")
    for ax in (rate, latency):
        ax.set_xticks(range(len(services)), [f"service {s['service']}" for s in services])
        ax.legend(fontsize=7)
    rate.set_ylabel("images per denoiser GPU-minute (burst)")
    latency.set_ylabel(f"latency, s ({services[0]['runs'][modes[0]]['steady']['rate_rps']} req/s)" if services else "")
    fig.savefig(path, dpi=110)


def plot_latent_parallel_live(report: Mapping, path: Path) -> None:
    """Per load: each system's latency CDF (all repeats), and the share of steps split."""
    fig = _figure(11, 4)
    axes = fig.subplots(1, 2)
    fig.suptitle(f"latent parallelism live, {report['size']}px {report['steps']} steps ({report['profile']})",
                 fontsize=10)
    for ax, load in zip(axes, ("light", "loaded")):
        for i, (name, runs) in enumerate(report["runs"].items()):
            latencies = sorted(x for run in runs for x in run[load]["latencies"] if x is not None)
            share = statistics.median(run[load]["split_share"] for run in runs)
            if latencies:
                ax.step(latencies, [(k + 1) / len(latencies) for k in range(len(latencies))], where="post",
                        color=f"C{i}", label=f"{name} ({share:.0%} of steps split)")
        ax.set_title(f"{load}", fontsize=9)
        ax.set_xlabel("latency, s")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_shapes(rows: Mapping[str, Mapping[str, float]], title: str, path: Path) -> None:
    """One bar per measured fraction of each row (prompt accuracy, silhouette IoU...)."""
    figure = _figure(9, 4)
    ax = figure.subplots()
    labels, values = [], []
    for row, measures in rows.items():
        for measure, value in measures.items():
            labels.append(f"{row}\n{measure}")
            values.append(value)
    bars = ax.bar(range(len(values)), values, color="C0")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set(ylim=(0, 1.05), title=title)
    figure.savefig(path, dpi=110)


def plot_fidelity(rows: Sequence[Mapping], title: str, path: Path) -> None:
    """Per approximation and setting: PSNR and SSIM against exact, and the change in prompt
    accuracy, defaults dark and more aggressive settings light, with the issue's bars (SSIM 0.9,
    3 points); approximations that cannot run are listed under the figure."""
    measured = [r for r in rows if "not_applicable" not in r]
    skipped = [r for r in rows if "not_applicable" in r]
    fig = _figure(15, 5.2)
    psnr, ssim, accuracy = fig.subplots(1, 3)
    fig.suptitle(title)
    x = range(len(measured))
    labels = [f"{r['approximation']}:\n{r['setting']}" for r in measured]
    colors = ["C0" if r["default"] else "C9" for r in measured]
    top = max([r["psnr_db"] for r in measured if r["psnr_db"] is not None] or [1.0])
    bars = psnr.bar(x, [top if r["psnr_db"] is None else r["psnr_db"] for r in measured], color=colors)
    psnr.bar_label(bars, ["equal" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}" for r in measured], fontsize=7)
    psnr.set_ylabel("PSNR vs exact, dB (all pictures)")
    bars = ssim.bar(x, [r["ssim"] for r in measured], color=colors)
    ssim.bar_label(bars, fmt="%.3f", fontsize=7)
    ssim.axhline(0.9, color="0.4", linestyle="--", linewidth=1)
    ssim.set(ylabel="SSIM vs exact (mean)", ylim=(0, 1.08))
    bars = accuracy.bar(x, [r["accuracy_change_points"] for r in measured], color=colors)
    accuracy.bar_label(bars, fmt="%+.1f", fontsize=7)
    accuracy.axhspan(-3, 3, color="0.9", zorder=0)
    accuracy.axhline(0, color="0.4", linewidth=0.8)
    accuracy.set_ylabel("prompt accuracy - exact's, points")
    for ax in (psnr, ssim, accuracy):
        ax.set_xticks(x, labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=6)
    fig.legend(handles=[Patch(color="C0", label="default"), Patch(color="C9", label="more aggressive")],
               fontsize=7, loc="outside upper right")
    if skipped:
        fig.supxlabel(textwrap.fill("not run: " + "; ".join(f"{r['approximation']} ({r['not_applicable']})"
                                                            for r in skipped), 200), fontsize=7)
    fig.savefig(path, dpi=110)


def plot_step_cache(report: Mapping, title: str, path: Path) -> None:
    """Per method and threshold: a request's speed-up (its denoising steps, and end to end) and its
    pictures' SSIM against exact, with every request of the batch caching, with half of them, and
    (where measured) with every one caching and skipping CFG, and the issue's bars (1.5x, SSIM 0.95)."""
    fig = _figure(12, 4.6)
    speed, ssim = fig.subplots(1, 2)
    fig.suptitle(title, fontsize=9)
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    batches = list(dict.fromkeys(r["batch"] for r in report["rows"]))  # all, half, and maybe all skipping CFG
    for m, method in enumerate(methods):
        for b, batch in enumerate(batches):
            rows = [r for r in report["rows"] if r["batch"] == batch and r["method"] == method]
            color = f"C{len(batches) * m + b}"
            label = f"{method}, {_caching_batch(batch, rows)}"
            ts = [r["threshold"] for r in rows]
            speed.plot(ts, [r["denoise_speedup"] for r in rows], "o-", color=color, label=f"{label}: denoising")
            speed.plot(ts, [r["speedup"] for r in rows], "s--", color=color, label=f"{label}: end to end")
            ssim.plot(ts, [r["ssim"] for r in rows], "o-", color=color, label=label)
    speed.axhline(1.5, color="0.4", linestyle="--", linewidth=1)
    speed.set(xlabel="step_cache threshold", ylabel="speed-up vs exact (batch times)")
    ssim.axhline(0.95, color="0.4", linestyle="--", linewidth=1)
    ssim.set(xlabel="step_cache threshold", ylabel="SSIM of the caching requests vs exact")
    speed.legend(fontsize=6)
    ssim.legend(fontsize=6)
    fig.savefig(path, dpi=110)


def _caching_batch(batch: str, rows: Sequence[Mapping]) -> str:
    """Who caches in a `bench_step_cache` batch label."""
    if batch == "all":
        return "every request caching"
    if batch == "half":
        return "half the batch caching"
    return f"every request caching and skipping CFG from {rows[0]['skip_cfg_from']:g}"


def plot_skip_cfg(report: Mapping, title: str, path: Path) -> None:
    """Against the fraction of the steps from which requests skip CFG: a request's speed-up (its
    denoising steps, and end to end) and its pictures' SSIM against exact (the model's skip-CFG
    curve), with every request of the batch skipping and with half of them, and the issue's bars."""
    fig = _figure(12, 4.6)
    speed, ssim = fig.subplots(1, 2)
    fig.suptitle(title, fontsize=9)
    for batch, color in (("all", "C0"), ("half", "C1")):
        rows = [r for r in report["rows"] if r["batch"] == batch]
        label = "every request" if batch == "all" else "half the batch"
        starts = [r["start"] for r in rows]
        speed.plot(starts, [r["denoise_speedup"] for r in rows], "o-", color=color, label=f"{label}: denoising")
        speed.plot(starts, [r["speedup"] for r in rows], "s--", color=color, label=f"{label}: end to end")
        ssim.plot(starts, [r["ssim"] for r in rows], "o-", color=color, label=f"{label} skipping")
    speed.axhline(report["rule"]["speedup_at_least"], color="0.4", linestyle="--", linewidth=1)
    speed.set(xlabel="skips CFG from this fraction of its steps", ylabel="speed-up vs exact (batch times)")
    ssim.axhline(report["rule"]["ssim_at_least"], color="0.4", linestyle="--", linewidth=1)
    ssim.set(xlabel="skips CFG from this fraction of its steps", ylabel="SSIM of the skipping requests vs exact")
    speed.legend(fontsize=6)
    ssim.legend(fontsize=6)
    fig.savefig(path, dpi=110)


def plot_synerdiff(report: Mapping, title: str, path: Path) -> None:
    """Per load point: each variant's throughput and P99 latency (the full stack, naive continuous
    batching, the serial decode and one ablation row per component)."""
    loads = report["loads"]
    fig = _figure(6 * len(loads), 4.8)
    fig.suptitle(title, fontsize=9)
    axes = fig.subplots(2, len(loads), squeeze=False)
    for column, load in enumerate(loads):
        names = list(load["rows"])
        colors = ["C2" if n == "SynerDiff" else "C3" if n.startswith("naive") else "0.6" for n in names]
        throughput, tail = axes[0][column], axes[1][column]
        throughput.barh(names, [load["rows"][n]["throughput_rps"] for n in names], color=colors)
        throughput.set(title=f"base rate {load['base_rate']:g} req/s (offered {load['offered_rps']:.2f})",
                       xlabel="throughput, req/s")
        tail.barh(names, [load["rows"][n]["latency_p99_s"] for n in names], color=colors)
        tail.set(xlabel="P99 latency, s")
        for ax in (throughput, tail):
            ax.invert_yaxis()
            ax.tick_params(labelsize=7)
    fig.savefig(path, dpi=110)


def plot_concurrency(report: Mapping, rows: Sequence[tuple], title: str, path: Path) -> None:
    """SynerDiff's offline profile: L(c) against the chunking c, and each round's time against its
    step's batch, by the decode chunks beside it (no skip-CFG), with the step alone."""
    fig = _figure(12, 4.6)
    cost, rounds = fig.subplots(1, 2)
    fig.suptitle(title, fontsize=9)
    timings = report["chunk_timings"]
    cost.plot([t["chunks"] for t in timings], [t["cost"] for t in timings], "o-")
    cost.axvline(report["chunks"], color="0.4", linestyle="--", linewidth=1)
    cost.set(xlabel="VAE chunks c", ylabel="L(c): weighted overhead vs alone (Eq. 1)")
    for n in sorted({r[2] for r in rows if r[1] and not r[3]}):
        points = sorted((r[1], r[4]) for r in rows if r[2] == n and r[1] and not r[3])
        rounds.plot([m for m, _ in points], [tau * 1000 for _, tau in points], "o-", label=f"{n} chunk(s) beside")
    rounds.set(xlabel="requests stepping (m)", ylabel="round, ms (tau)")
    rounds.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def plot_elastic_pool(report: Mapping, path: Path) -> None:
    """Per row: the pool's size over time, and the SLO attainment of the requests arriving in each
    window; the offered rate of each phase behind both."""
    fig = _figure(11.0, 6.5)
    size_ax, slo_ax = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    end = sum(p["duration_s"] for p in report["phases"])
    for run in report["runs"]:
        times = [t for t, _ in run["pool"]] + [end]
        sizes = [n for _, n in run["pool"]] + [run["pool"][-1][1]]
        size_ax.step(times, sizes, where="post", label=f"{run['label']}: {run['worker_s']:.0f} worker-s")
        windows = [w for w in run["windows"] if w["slo_attainment"] is not None]
        attained = 100 * (run["summary"]["slo_attainment"] or 0)
        slo_ax.plot([w["start_s"] + report["window_s"] / 2 for w in windows],
                    [100 * w["slo_attainment"] for w in windows], marker="o", markersize=3,
                    label=f"{run['label']}: {attained:.1f}% overall")
    for ax in (size_ax, slo_ax):
        rate_ax = ax.twinx()
        start, xs, ys = 0.0, [], []
        for phase in report["phases"]:
            xs += [start, start + phase["duration_s"]]
            ys += [phase["rate"], phase["rate"]]
            start += phase["duration_s"]
        rate_ax.fill_between(xs, ys, color="0.9", zorder=0)
        rate_ax.set_ylabel("offered req/s", color="0.5")
        ax.set_zorder(rate_ax.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.legend(fontsize=8, loc="upper left")
    size_ax.set_ylabel("workers (serving, starting, draining)")
    slo_ax.set_ylabel(f"SLO attainment (%), by {report['window_s']:g} s of arrival")
    slo_ax.set_xlabel("time (s)")
    fig.suptitle(f"{report['model']} ({report['profile']}, derived), SLO {report['slo_scale']:g}x solo; a worker "
                 f"serves {report['worker_start_s']:g} s after it is started")
    fig.savefig(path, dpi=110)
