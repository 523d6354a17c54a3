"""The fidelity of patched batching (PatchedServe §4, Table 2): requests of different sizes are
denoised together, every step one UNet forward over all their patches, and each final image is
compared with the same request denoised alone, unpatched (PSNR, SSIM).

Two GroupNorm modes (`engine.patched.NormStats`): per-image statistics, which make the patched
forward exact (PSNR limited only by float rounding), and per-patch statistics, the paper's
cheaper stitcher, whose seams cost fidelity that grows as patches shrink. The paper reports for
SDXL at 1024x1024 without cache 22.1 / 24.8 / 28.8 dB at patch 128 / 256 / 512 pixels; a tiny
random-weight preset gives figures of the same kind, not the same values.

    python -m stepserve.load_tests.bench_patch_fidelity --out docs/results/patch-fidelity
    python -m stepserve.load_tests.bench_patch_fidelity --family sdxl --preset full --device cuda ...

Writes patch_fidelity.json and patch_fidelity.png (per request of the first seed, left to right:
unpatched, exact patched, then per-patch statistics at each patch side, largest first).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.patched import NormStats, patched_unet_forward
from stepserve.engine.sampler import Sampler
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.load_tests.fidelity import psnr, ssim
from stepserve.policies.types import RequestSpec

PROMPTS = ("a lighthouse at dusk", "a red fox in snow", "a bowl of fruit on a table")


def denoise_unpatched(family, specs: list[RequestSpec]) -> list[np.ndarray]:
    """Each request alone, the plain UNet forward: the reference."""
    images = []
    for spec in specs:
        sampler = Sampler(spec, family, encode_conditioning(family, spec))
        while not sampler.done:
            sampler.step(family)
        images.append(family.decode(sampler.latents)[0])
    return images


@torch.inference_mode()
def denoise_patched(family, specs: list[RequestSpec], patch: int | None, stats: NormStats) -> list[np.ndarray]:
    """All requests together (equal step counts), each step one patched forward over all their rows."""
    samplers = [Sampler(spec, family, encode_conditioning(family, spec)) for spec in specs]
    while not samplers[0].done:
        inputs = [s.model_input() for s in samplers]
        conditioning = [family.denoiser_inputs(cond) for _, _, cond in inputs]
        added = [c["added_cond_kwargs"] for c in conditioning if "added_cond_kwargs" in c]
        outs = patched_unet_forward(
            family.denoiser, [sample for sample, _, _ in inputs], torch.cat([t for _, t, _ in inputs]),
            torch.cat([c["encoder_hidden_states"] for c in conditioning]),
            {k: torch.cat([a[k] for a in added]) for k in added[0]} if added else None, patch=patch, stats=stats,
        )
        for sampler, out in zip(samplers, outs):
            sampler.advance(out)
    return [family.decode(s.latents)[0] for s in samplers]


def _db(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_patch_fidelity",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="sd15", choices=["sd15", "sdxl"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 192, 256], help="square image sides (pixels)")
    parser.add_argument("--patches", type=int, nargs="+", default=[64, 32, 16], help="patch sides (pixels)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    family = load_family(ModelSource(name="bench", family=args.family, preset=args.preset), ALL_PARTS, args.device)
    scale = family.vae_scale_factor
    modes = [("exact", None, NormStats.IMAGE)] + [(f"patch_stats_{p}px", p // scale, NormStats.PATCH)
                                                 for p in args.patches]
    rows, grid, started = [], [], time.perf_counter()
    for seed in args.seeds:
        specs = [RequestSpec(request_id=f"s{seed}-{size}", model="bench", prompt=PROMPTS[i % len(PROMPTS)],
                             width=size, height=size, num_inference_steps=args.steps, guidance_scale=7.5,
                             seed=seed * 100 + i) for i, size in enumerate(args.sizes)]
        reference = denoise_unpatched(family, specs)
        images = {name: denoise_patched(family, specs, patch, stats) for name, patch, stats in modes}
        for i, spec in enumerate(specs):
            for name, patch, stats in modes:
                rows.append({"seed": seed, "size_px": spec.width, "mode": name, "stats": stats.value,
                             "patch_px": None if patch is None else patch * scale,
                             "psnr_db": _db(psnr(images[name][i], reference[i])),
                             "ssim": ssim(images[name][i], reference[i])})
            if seed == args.seeds[0]:
                grid.append([reference[i]] + [images[name][i] for name, _, _ in modes])
    summary = []
    for name, patch, stats in modes:
        for size in args.sizes:
            picked = [r for r in rows if r["mode"] == name and r["size_px"] == size]
            values = [math.inf if r["psnr_db"] == "inf" else r["psnr_db"] for r in picked]
            summary.append({"mode": name, "stats": stats.value, "patch_px": None if patch is None else patch * scale,
                            "size_px": size, "median_psnr_db": _db(statistics.median(values)),
                            "median_ssim": statistics.median(r["ssim"] for r in picked)})
    report = {"benchmark": "patch_fidelity",
              "setup": {**vars(args), "out": str(args.out), "torch": torch.__version__,
                        "wall_s": round(time.perf_counter() - started, 1)},
              "paper_sdxl_1024_psnr_db": {"128px": 22.13, "256px": 24.84, "512px": 28.82},
              "summary": summary, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "patch_fidelity.json").write_text(json.dumps(report, indent=1))
    _write_grid(grid, args.out / "patch_fidelity.png")
    for s in summary:
        print(f"{s['mode']:>18} {s['size_px']}px: PSNR {s['median_psnr_db']} dB, SSIM {s['median_ssim']:.4f}")
    return 0


def _write_grid(grid: list[list[np.ndarray]], path: Path) -> None:
    """One row per request, images side by side, top-left aligned, 4-pixel white gaps."""
    gap = 4
    heights = [max(im.shape[0] for im in row) for row in grid]
    width = max(sum(im.shape[1] + gap for im in row) for row in grid)
    canvas = np.ones((sum(h + gap for h in heights), width, 3))
    top = 0
    for row, height in zip(grid, heights):
        left = 0
        for im in row:
            canvas[top:top + im.shape[0], left:left + im.shape[1]] = im
            left += im.shape[1] + gap
        top += height + gap
    PIL.Image.fromarray((canvas * 255).round().astype(np.uint8)).save(path)


if __name__ == "__main__":
    sys.exit(main())
