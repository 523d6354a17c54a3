"""Writes sd15-a100.csv: a GPU-magnitude profile for SD1.5 on an A100, DERIVED from published
figures (nothing here was measured on an A100). README.md in this folder gives every source.

    python configs/profiles/derive_sd15_a100.py            # rewrite sd15-a100.csv
    python configs/profiles/derive_sd15_a100.py --recount  # recount the FLOPs used below

Rules:
- Per-step denoise at 512 px comes from the diffusers A100 benchmark (iterations/s of the
  SD1.5 text-to-image loop at batch 1, 4, 16 with CFG: 2, 8, 32 UNet rows), interpolated
  piecewise-linearly in rows and extended linearly beyond the ends.
- Other resolutions: a row at P pixels costs what F_unet(P) / F_unet(512) rows cost at 512 px
  (UNet FLOPs counted with torch.utils.flop_counter on the SD1.5 UNet config).
- Text encode and VAE decode: NVIDIA's TensorRT SD1.5 breakdown gives CLIP and VAE time
  relative to one UNet step on the same GPU; those ratios are applied to the eager 512 px
  step above. Extra texts and larger images add their FLOPs at the UNet's effective rate
  (text) or scale by the decoder's FLOP ratio (VAE).
- PNG encoding (part of vae_decode in stepserve) was measured on the CPU of the machine this
  repo was developed on and scales with pixels.
- Round and request overheads: InstGenIE §6.6's measured per-step batching and per-request
  scheduling/serialization/communication costs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stepserve.policies.cost_model import (
    DENOISE,
    REQUEST_OVERHEAD,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    ProfileRow,
    write_profile,
)

MODEL = "stable-diffusion-v1-5"  # the name configs/cluster.yaml serves SD1.5 under
DEVICE = "a100"
OUT = Path(__file__).with_name("sd15-a100.csv")

# diffusers docs, "Accelerated PyTorch 2.0 support in Diffusers", Benchmark tables, A100,
# "SD - txt2img", torch 2.0 no compile: iterations/s at batch 1, 4, 16 (512x512, fp16, CFG 7.5).
DIFFUSERS_IT_PER_S = {1: 21.66, 4: 11.6, 16: 3.04}
ANCHORS = sorted((2 * batch, 1000.0 / its) for batch, its in DIFFUSERS_IT_PER_S.items())  # (rows, ms/step)

# FLOPs (GFLOP) counted here with torch.utils.flop_counter.FlopCounterMode on the SD1.5
# configs in engine/families/sd15.py (FULL preset, meta tensors): UNet per row, VAE decode of
# one image, CLIP text encoder per 77-token text. `--recount` reproduces them.
UNET_GFLOP = {512: 803.27, 768: 2148.12, 1024: 4674.01}
VAE_GFLOP = {512: 2514.52, 768: 5754.30, 1024: 10470.39}
CLIP_GFLOP = 13.30

# NVIDIA, "Stable Diffusion 推理加速技巧解析" (TensorRT 8.5.2.2 SD1.5 demo, bs=1, 512x512):
# UNet x 50 = 792 ms, CLIP = 4 ms, VAE = 19 ms. Only the ratios to one UNet step are used.
TRT_UNET_STEP_MS = 792 / 50
TRT_CLIP_MS = 4.0
TRT_VAE_MS = 19.0

# encode_png (PIL, compress_level=1) of smooth 512/768/1024 px images: 283/272/273 ms per
# megapixel, median of 9, on the 2-core Xeon VM this repo is developed on (under load).
PNG_MS_PER_MPX = 275.0

# InstGenIE (instgenie.txt §6.6): per denoising step, batching takes 1.2 ms; per request,
# scheduling 0.6 ms, latent serialization 1.1 ms and communication 1.3 ms.
ROUND_FIXED_MS = 1.2
REQUEST_OVERHEAD_MS = 0.6 + 1.1 + 1.3

SIZES = (512, 768, 1024)
BATCHES = tuple(range(1, 17))
TEXTS = (1, 2, 4, 8, 16, 32)

DIFFUSERS = "diffusers docs torch2.0 benchmark (A100 SD1.5 txt2img it/s at batch 1/4/16)"
DERIVED = "derived, not measured; see configs/profiles/README.md"


def step_ms_at_512(rows: float) -> float:
    """Piecewise-linear through the anchors, extended linearly beyond them."""
    (r0, t0), (r1, t1), (r2, t2) = ANCHORS
    if rows <= r1:
        return t0 + (rows - r0) * (t1 - t0) / (r1 - r0)
    return t1 + (rows - r1) * (t2 - t1) / (r2 - r1)


def last_slope_ms_per_row() -> float:
    (_, _), (r1, t1), (r2, t2) = ANCHORS
    return (t2 - t1) / (r2 - r1)


def denoise_ms(size: int, rows: int) -> float:
    return step_ms_at_512(rows * UNET_GFLOP[size] / UNET_GFLOP[512])


def text_encode_ms(texts: int) -> float:
    first = TRT_CLIP_MS / TRT_UNET_STEP_MS * step_ms_at_512(2)
    gflop_per_ms = UNET_GFLOP[512] / last_slope_ms_per_row()  # the UNet's effective compute rate
    return first + (texts - 1) * CLIP_GFLOP / gflop_per_ms


def vae_decode_ms(size: int) -> float:
    gpu = TRT_VAE_MS / TRT_UNET_STEP_MS * step_ms_at_512(2) * VAE_GFLOP[size] / VAE_GFLOP[512]
    return gpu + PNG_MS_PER_MPX * size * size / 1e6


def rows() -> list[ProfileRow]:
    def row(component, ms, source, height=0, width=0, n=1):
        return ProfileRow(MODEL, DEVICE, component, height, width, n, 1, ms, 1, f"{source}; {DERIVED}")

    out = []
    for size in SIZES:
        for n in sorted({b for b in BATCHES} | {2 * b for b in BATCHES}):
            out.append(row(DENOISE, denoise_ms(size, n), f"{DIFFUSERS} x UNet FLOP ratio", size, size, n))
        out.append(row(VAE_DECODE, vae_decode_ms(size),
                       "NVIDIA TensorRT SD1.5 VAE/UNet-step ratio x VAE FLOP ratio + PNG measured on CPU", size, size))
    for n in TEXTS:
        out.append(row(TEXT_ENCODE, text_encode_ms(n), "NVIDIA TensorRT SD1.5 CLIP/UNet-step ratio + CLIP FLOPs",
                       n=n))
    out.append(row(ROUND_OVERHEAD, ROUND_FIXED_MS, "InstGenIE §6.6 per-step batching cost"))
    out.append(row(REQUEST_OVERHEAD, REQUEST_OVERHEAD_MS, "InstGenIE §6.6 scheduling + serialization + communication"))
    return out


def recount() -> None:
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CLIPTextModel

    from stepserve.engine.families.presets import autoencoder_kl, clip_text_config
    from stepserve.engine.families.sd15 import FULL

    def gflop(fn) -> float:
        with FlopCounterMode(display=False) as mode, torch.no_grad():
            fn()
        return mode.get_total_flops() / 1e9

    with torch.device("meta"):
        unet = UNet2DConditionModel(in_channels=4, out_channels=4, **FULL["unet"]).eval()
        vae = autoencoder_kl(FULL["vae"]).eval()
        clip = CLIPTextModel(clip_text_config(FULL["text"])).eval()
        context = torch.empty(1, 77, 768)
        for size in SIZES:
            latents = torch.empty(1, 4, size // 8, size // 8)
            print(f"{size}px: UNet/row {gflop(lambda: unet(latents, torch.tensor([500.0]), context)):.2f} GFLOP, "
                  f"VAE decode {gflop(lambda: vae.decode(latents)):.2f} GFLOP")
        print(f"CLIP text encoder: {gflop(lambda: clip(torch.zeros(1, 77, dtype=torch.long))):.2f} GFLOP per text")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recount", action="store_true", help="recount the FLOPs instead of writing the CSV")
    args = parser.parse_args()
    if args.recount:
        recount()
        return
    write_profile(OUT, rows())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
