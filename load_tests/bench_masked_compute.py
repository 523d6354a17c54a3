"""Mask-aware computation (InstGenIE §3.1, Table 1, Fig. 7): one SD3 transformer forward computed
exactly against the masked forward that recomputes only the masked image tokens and takes the
others from cached activations, at several mask ratios, with either cache kind
(`engine.editing.masked_sd3.CacheKind`, `--cache`): each block's outputs (the paper's approach:
keys and values are still projected for every token) or each block's keys and values (its
alternative: only the masked tokens are computed, attending over every key, for a record about
twice the size).

One edit request with classifier-free guidance: 2 rows, the same latents, different text. Its
activations are recorded once from these very inputs (a self-cache), so the masked output must
equal the exact one within float tolerance: the reported difference checks the comparison
compares the same work, and ratio 1.0 (every token masked) checks the masked path's overhead.
With a self-cache both kinds compute the masked tokens from the same values (bit for bit on
CPU), so their differences from the exact output agree. Every block uses the cache (what the
bubble-free DP picks when loading is free, and what a keys-values record needs): this is compute
alone, cache loading is not timed. Weights are random, built from the config with a fixed seed:
nothing is downloaded. Cases are timed round-robin after warmup; on CUDA every timing
synchronizes.

    python -m stepserve.load_tests.bench_masked_compute --config medium-cpu --threads 1 --out results/masked-cpu
    python -m stepserve.load_tests.bench_masked_compute --config sd3-medium --device cuda --dtype bfloat16 \\
        --out results/masked-gpu

Writes masked_compute.json and masked_compute.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import SD3Transformer2DModel
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stepserve.engine.editing.masked_sd3 import (
    CacheKind, MaskedPlan, SD3Inputs, masked_forward, plain_forward, recording_forward, token_index,
)
from stepserve.engine.families.presets import created_as
from stepserve.engine.families.sd3 import TINY
from stepserve.profiling.common import Stopwatch, device_description, interleaved_times, log, set_threads

VAE_SCALE = 8  # SD3's VAE: 8x downscale, 16 latent channels
ROWS = 2  # one request with classifier-free guidance


@dataclass(frozen=True)
class BenchConfig:
    """A transformer config and the work one forward does with it."""

    transformer: dict[str, Any]
    image_size: int  # pixels a side
    text_tokens: int  # context length (SD3: 77 CLIP tokens + 256 T5 tokens)


CONFIGS = {
    "tiny": BenchConfig(TINY["transformer"], image_size=256, text_tokens=16),
    # Compute-bound on a small CPU: 1024 image tokens at width 512, about a second a forward.
    "medium-cpu": BenchConfig(
        dict(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=64,
             num_attention_heads=8, joint_attention_dim=1024, caption_projection_dim=512,
             pooled_projection_dim=512, pos_embed_max_size=64),
        image_size=512, text_tokens=77,
    ),
    # stabilityai/stable-diffusion-3-medium's transformer config (no dual attention, no qk norm).
    "sd3-medium": BenchConfig(
        dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
             pooled_projection_dim=2048, pos_embed_max_size=192),
        image_size=1024, text_tokens=77 + 256,
    ),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_masked_compute", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="medium-cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA (random weights overflow float16 more easily)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.5, 1.0])
    parser.add_argument("--cache", choices=[kind.value for kind in CacheKind] + ["both"], default="both",
                        help="the cache kinds timed against the exact forward (default: both)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own); 1 is steadier on a shared machine")
    return parser.parse_args(argv)


def build_transformer(config: BenchConfig, device: torch.device, dtype: torch.dtype,
                      seed: int) -> SD3Transformer2DModel:
    """Random weights of the real class, created on the device in the benchmark dtype (a 2B
    model initialised on the host in float32 would be slow and large)."""
    torch.manual_seed(seed)
    with device, created_as(dtype):
        return SD3Transformer2DModel(**config.transformer).eval()


def make_inputs(transformer: SD3Transformer2DModel, config: BenchConfig, seed: int) -> SD3Inputs:
    """CFG's two rows: the same latents, two texts, one timestep."""
    g = torch.Generator().manual_seed(seed)
    cfg, side = transformer.config, config.image_size // VAE_SCALE
    latents = torch.randn(1, cfg.in_channels, side, side, generator=g).expand(ROWS, -1, -1, -1).contiguous()
    context = torch.randn(ROWS, config.text_tokens, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(ROWS, cfg.pooled_projection_dim, generator=g)
    on_device = dict(device=transformer.device, dtype=transformer.dtype)
    # The timestep stays float32, as the pipeline passes it (the scheduler's timesteps).
    return SD3Inputs(latents.to(**on_device), context.to(**on_device), pooled.to(**on_device),
                     torch.full((ROWS,), 500.0, device=transformer.device))


def box_mask(latent_side: int, patch: int, ratio: float) -> torch.Tensor:
    """A centred rectangle of whole patches covering about `ratio` of the image: [ROWS, 1, h, w]."""
    grid = latent_side // patch
    rows = max(1, min(grid, round(grid * ratio ** 0.5)))
    cols = max(1, min(grid, round(ratio * grid * grid / rows)))
    top, left = (grid - rows) // 2, (grid - cols) // 2
    mask = torch.zeros(ROWS, 1, grid, grid)
    mask[:, :, top : top + rows, left : left + cols] = 1
    return mask.repeat_interleave(patch, dim=2).repeat_interleave(patch, dim=3)


def difference(out: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    out, exact = out.float(), exact.float()
    return {"max_abs": (out - exact).abs().max().item(), "rel_l2": ((out - exact).norm() / exact.norm()).item()}


def kind_figures(exact_s: list[float], masked_s: list[float], vs_exact: dict[str, float]) -> dict[str, Any]:
    """One cache kind's figures at one mask ratio: median, speedups by median and by best
    sample, all samples."""
    median = statistics.median(masked_s)
    return {"masked_s": median, "speedup": statistics.median(exact_s) / median,
            "speedup_best": min(exact_s) / min(masked_s), "masked_samples_s": masked_s, "vs_exact": vs_exact}


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = set_threads(args.threads)
    config = CONFIGS[args.config]
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    kinds = list(CacheKind) if args.cache == "both" else [CacheKind(args.cache)]
    transformer = build_transformer(config, device, dtype, args.seed)
    inputs = make_inputs(transformer, config, args.seed)
    records = {}
    for kind in kinds:
        exact, records[kind] = recording_forward(transformer, inputs, kind)
    patch = transformer.config.patch_size
    tokens = (config.image_size // VAE_SCALE // patch) ** 2
    indices = {ratio: token_index(box_mask(config.image_size // VAE_SCALE, patch, ratio).to(device), patch)
               for ratio in args.ratios}
    plans = {(ratio, kind): MaskedPlan(index, records[kind], [True] * len(records[kind]), kind)
             for ratio, index in indices.items() for kind in kinds}
    cases = {"exact": lambda: plain_forward(transformer, inputs)}
    for key, plan in plans.items():
        cases[key] = lambda plan=plan: masked_forward(transformer, inputs, plan)
    log(f"{args.config} on {device_description(args.device)}, {dtype}: {tokens} image tokens, "
        f"{len(transformer.transformer_blocks)} blocks, {ROWS} rows, {threads} threads; cached "
        + ", ".join(f"{kind.value} {_mib(record):.0f} MiB" for kind, record in records.items()))
    times = interleaved_times(cases, Stopwatch(args.device), args.warmup, args.repeats)
    rows = [{"mask_ratio": ratio, "token_ratio": index.shape[1] / tokens,
             "exact_s": statistics.median(times["exact"]), "exact_samples_s": times["exact"],
             "cache": {kind.value: kind_figures(times["exact"], times[(ratio, kind)],
                                                difference(masked_forward(transformer, inputs, plans[(ratio, kind)]),
                                                           exact))
                       for kind in kinds}}
            for ratio, index in indices.items()]
    return {
        "benchmark": "masked_compute",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_description(args.device),
        "config": args.config, "dtype": str(dtype).removeprefix("torch."),
        "transformer": config.transformer, "image_size": config.image_size, "text_tokens": config.text_tokens,
        "image_tokens": tokens, "rows": ROWS, "threads": threads, "warmup": args.warmup, "repeats": args.repeats,
        "cache_mb": {kind.value: _mib(record) for kind, record in records.items()},
        "exact_output_finite": bool(torch.isfinite(exact).all()),
        "results": rows,
    }


def _mib(record: list[torch.Tensor]) -> float:
    """One forward's record, in MiB."""
    return sum(t.numel() * t.element_size() for t in record) / 2**20


def plot(result: dict[str, Any], path: Path) -> None:
    """Forward time per case, and speedup against the token ratio per cache kind next to Table
    1's ideal 1/m (with cached outputs keys and values still cover every token, so the real
    speedup stays below it; with cached keys and values only attention still reads every token)."""
    figure = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(figure)
    times, speed = figure.subplots(1, 2)
    figure.suptitle(f"masked SD3 forward: {result['config']}, {result['dtype']}, {result['device']}", fontsize=9)
    rows = result["results"]
    kinds = list(rows[0]["cache"])
    width = 0.8 / (1 + len(kinds))
    for k, name in enumerate(["exact"] + kinds):
        x = [i + (k - len(kinds) / 2) * width for i in range(len(rows))]
        seconds = [r["exact_s"] if name == "exact" else r["cache"][name]["masked_s"] for r in rows]
        bars = times.bar(x, seconds, width, label=name, color="grey" if name == "exact" else f"C{k - 1}")
        times.bar_label(bars, fmt="%.3f", fontsize=6)
    times.set_xticks(range(len(rows)), [f"m={r['token_ratio']:.2f}" for r in rows])
    times.set(ylabel="seconds per forward", title=f"one forward, {result['rows']} rows (CFG)")
    times.legend(fontsize=7, title="cached", title_fontsize=7)
    ratios = [r["token_ratio"] for r in rows]
    for k, name in enumerate(kinds):
        speed.plot(ratios, [r["cache"][name]["speedup"] for r in rows], "o-", color=f"C{k}", label=f"{name}: medians")
        speed.plot(ratios, [r["cache"][name]["speedup_best"] for r in rows], "x:", color=f"C{k}",
                   label=f"{name}: best samples")
    speed.plot(ratios, [1 / m for m in ratios], "--", color="grey", label="1/m (Table 1)")
    speed.set(xlabel="masked token ratio m", ylabel="speedup over exact", title="speedup", yscale="log")
    speed.grid(alpha=0.3)
    speed.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "masked_compute.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "masked_compute.png")
    for row in result["results"]:
        log(f"m={row['token_ratio']:.3f}: exact {row['exact_s']:.3f} s; " + "; ".join(
            f"{name} {c['masked_s']:.3f} s, {c['speedup']:.2f}x (best samples {c['speedup_best']:.2f}x), "
            f"rel diff {c['vs_exact']['rel_l2']:.2e}" for name, c in row["cache"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
