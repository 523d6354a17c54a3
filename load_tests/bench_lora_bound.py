"""How late a LoRA may join a request (SwiftDiffusion §4.2, Fig. 11), and what joining late costs.

For each seed, the request is denoised twice in lockstep, with its LoRA from the first step and
without it; the cosine similarity of the two latents after every step is the paper's criterion:
the bound k is the first step where it drops below the threshold (0.99), and `k / steps` is what
`lora_loading.join_by` may be set to. Then the request is denoised with the LoRA joining at step
j for j = 0 .. k (and beyond), and each image is compared with the exact one (j = 0): PSNR and
SSIM, the fidelity of the late-LoRA switch.

    stepserve lora-bound --out results/lora-bound                        # tiny SD1.5 + a preset LoRA, CPU
    stepserve lora-bound --family sdxl --preset full --device cuda --steps 50 --out results/lora-bound-gpu
    stepserve lora-bound --model-path /models/sdxl --family sdxl --lora-path /loras/papercut.safetensors ...

Writes lora_bound.json and lora_bound.png. With random preset weights the curve says nothing about
a real LoRA's semantics; run it on the served model and LoRAs to choose join_by.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from stepserve.engine.addons.lora import load_lora_file
from stepserve.engine.addons.presets import preset_lora
from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.sampler import Sampler
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.load_tests.fidelity import psnr, ssim
from stepserve.load_tests.plots import plot_lora_bound
from stepserve.policies.types import LoraUse, RequestSpec

LORA = "lora"


def similarities(family, spec: RequestSpec) -> list[float]:
    """Cosine similarity of the latents with and without the LoRA after each step."""
    with_lora = Sampler(spec, family, encode_conditioning(family, spec))
    plain_spec = RequestSpec(**{**spec.__dict__, "loras": ()})
    without = Sampler(plain_spec, family, encode_conditioning(family, plain_spec))
    out = []
    while not with_lora.done:
        with_lora.step(family)
        without.step(family)
        a, b = with_lora.latents.flatten().double(), without.latents.flatten().double()
        out.append(float(torch.dot(a, b) / (a.norm() * b.norm())))
    return out


def bound(sims: list[float], threshold: float) -> int:
    """The first step whose similarity is below `threshold` (the last step if none is)."""
    return next((i for i, s in enumerate(sims) if s < threshold), len(sims) - 1)


def joined_at(family, spec: RequestSpec, join: int) -> np.ndarray:
    """The image with the LoRA applying from step `join` on."""
    lora = family.loras.pop(LORA)  # away until the join: `Sampler.step` applies what the family holds
    try:
        sampler = Sampler(spec, family, encode_conditioning(family, spec))
        while not sampler.done:
            if sampler.step_index == join:
                family.loras[LORA] = lora
            sampler.step(family)
    finally:
        family.loras[LORA] = lora
    return family.decode(sampler.latents)[0]


def _db(value: float) -> float | None:
    """A PSNR for JSON, which has no infinity: identical to exact (inf) is null."""
    return None if math.isinf(value) else value


def measure(family, seeds: list[int], steps: int, size: int, scale: float, threshold: float) -> dict:
    per_seed = []
    for seed in seeds:
        spec = RequestSpec(request_id=f"bound-{seed}", model=family.source.name, prompt="an owl standing on a wire",
                           width=size, height=size, num_inference_steps=steps, guidance_scale=7.5, seed=seed,
                           loras=(LoraUse(LORA, scale),))
        sims = similarities(family, spec)
        k = bound(sims, threshold)
        exact = joined_at(family, spec, 0)
        joins = sorted({0, *range(1, steps, max(1, steps // 10)), k})
        fidelity = []
        for j in joins:
            image = joined_at(family, spec, j)
            fidelity.append({"join_step": j, "psnr_db": _db(psnr(image, exact)), "ssim": ssim(image, exact)})
        per_seed.append({"seed": seed, "similarity": sims, "bound_step": k, "fidelity": fidelity})
    ks = [s["bound_step"] for s in per_seed]
    at_bound = [next(f for f in s["fidelity"] if f["join_step"] == s["bound_step"]) for s in per_seed]
    return {
        "seeds": per_seed,
        "bound_step_median": statistics.median(ks),
        "join_by": statistics.median(ks) / steps,
        "psnr_at_bound_db_median": _db(statistics.median(math.inf if f["psnr_db"] is None else f["psnr_db"]
                                                         for f in at_bound)),
        "ssim_at_bound_median": statistics.median(f["ssim"] for f in at_bound),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve lora-bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="sd15", choices=["sd15", "sdxl"])
    parser.add_argument("--preset", default="tiny", help="random-weight preset (default: %(default)s)")
    parser.add_argument("--model-path", help="a local diffusers folder instead of a preset")
    parser.add_argument("--lora-path", help="a LoRA .safetensors file (default: a preset LoRA)")
    parser.add_argument("--lora-scale", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--threshold", type=float, default=0.99)
    parser.add_argument("--out", default="results/lora-bound")
    args = parser.parse_args(argv)

    where = dict(path=args.model_path) if args.model_path else dict(preset=args.preset)
    source = ModelSource(name="bench", family=args.family, dtype=args.dtype, **where)
    family = load_family(source, ALL_PARTS, args.device)
    lora = load_lora_file(LORA, args.lora_path) if args.lora_path else preset_lora(LORA, family.denoiser, seed=11)
    family.add_lora(lora)
    result = measure(family, args.seeds, args.steps, args.size, args.lora_scale, args.threshold)
    result["setup"] = {**vars(args), "lora_bytes": lora.nbytes, "machine": platform.node(),
                       "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_bound.json").write_text(json.dumps(result, indent=2, allow_nan=False))
    plot_lora_bound(result, f"LoRA join bound: {args.family} {args.model_path or args.preset}, {args.steps} steps",
                    out / "lora_bound.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("seeds", "setup")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
