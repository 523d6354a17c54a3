"""Writes sdxl-h800.csv: a GPU-magnitude profile for SDXL (stable-diffusion-xl-base-1.0) on an H800,
DERIVED from published figures (nothing here was measured on an H800). README.md in this folder
gives every source.

    python configs/profiles/derive_sdxl_h800.py            # rewrite sdxl-h800.csv
    python configs/profiles/derive_sdxl_h800.py --recount  # recount the FLOPs used below

Rules:
- Work: a denoise row at P pixels is x = F_unet(P) / F_unet(512) "512 px rows" of work, so
  rows * x measures a forward (UNet FLOPs counted with torch.utils.flop_counter on the SDXL
  UNet config; 1 row at 1024 px = 4.26 rows at 512 px).
- Shape: a forward of w such rows takes T * (w^n + X^n)^(1/n) ms, a smoothed roofline: flat
  at T * X while the UNet cannot fill the GPU, T ms per row once it does. n and X are solved
  so that batching 1 -> 8 CFG requests (rows 2 -> 16) raises UNet throughput 3.31x at 512 px
  and 1.21x at 1024 px (SynerDiff §II-A; its GPU and batch range are not stated: the batch
  range is assumed to be its serving maximum of 8, with CFG, and the shape is assumed to hold
  on the H800).
- Scale: T is solved so that one 1024 px request, 50 steps with CFG, alone, takes SwiftDiffusion's
  2.9 s (Diffusers, H800, SDXL base model alone) without PNG encoding: text encode of 2 texts +
  50 * (step + round overhead) + VAE decode on the GPU + request overhead = 2.9 s.
- VAE decode: the same decoder as SD1.5's (identical counted FLOPs). It runs at the share of
  the UNet's saturated FLOP rate that derive_sd15_a100.py's rules give it (NVIDIA's TensorRT
  SD1.5 VAE/UNet-step ratio against the diffusers A100 benchmark), x2 because SDXL's VAE
  decodes in float32 (force_upcast): a memory-bound network moving fp32 activations moves
  twice the bytes (and TF32 convolutions run at half the fp16 tensor rate).
- Text encode: one call is latency-bound (77 tokens cannot fill a GPU), so it is
  derive_sd15_a100.py's CLIP-L call scaled by transformer layers, (12 + 32) / 12, for SDXL's
  two encoders; each extra text adds both encoders' FLOPs at the UNet's saturated rate.
- PNG encoding (part of vae_decode in stepserve) was measured on the CPU of the machine this
  repo was developed on and scales with pixels, as in derive_sd15_a100.py.
- Round and request overheads: InstGenIE §6.6's measured per-step batching and per-request
  scheduling/serialization/communication costs.
- Add-ons (SwiftDiffusion §4.1-§4.2, §6.3): a ControlNet call over some rows takes the UNet's
  forward over as many rows times their counted FLOP ratio (0.45: its blocks are the UNet's
  encoder blocks, at the same tokens and batch, so they run as efficiently); the UNet's encoder half
  (down and mid blocks, what a ControlNet beside it overlaps) takes the FLOP share of the forward;
  a call's residuals cross NVLink (SwiftDiffusion's H800 setup; 0.1 ms + bytes at 200 GB/s); a
  LoRA is rank 128 on the attention projections (to_q/k/v/out: a 341 MiB fp16 file, the paper's
  LoRA, gives rank 123), its unmerged updates running at half the UNet's saturated FLOP rate
  (assumed: thin GEMMs).
- A LoRA brought to a worker: the paper's 341 MiB file from host memory (the node's LoRA store) to
  the GPU over PCIe 4.0 x16, 25 GB/s: 14.3 ms.
- Latent parallelism (SwiftDiffusion §4.3): a CFG split swaps the two rows' noise predictions
  (4 latent channels, fp16) over NVLink, 0.05 ms + bytes at 200 GB/s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stepserve.policies.cost_model import (
    CFG_EXCHANGE,
    CONTROLNET,
    CONTROLNET_TRANSFER,
    DENOISE,
    DENOISE_ENCODER,
    LORA,
    LORA_LOAD,
    REQUEST_OVERHEAD,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    ProfileRow,
    write_profile,
)

MODEL = "stable-diffusion-xl-base-1.0"  # the name configs/cluster.yaml's (commented) SDXL entry serves it under
DEVICE = "h800"
OUT = Path(__file__).with_name("sdxl-h800.csv")

# SwiftDiffusion (swiftdiffusion.txt §1 and §3.1, Fig. 2, "0C/0L"): serving the SDXL base model
# alone with Diffusers on an H800 takes 2.9 s; §6.1: 50 denoising steps at 1024x1024 (CFG on, §2).
# Diffusers hands back a PIL image, so the 2.9 s is read as excluding PNG encoding.
ANCHOR_MS = 2900.0
ANCHOR_SIZE = 1024
ANCHOR_STEPS = 50

# SynerDiff (synerdiff.txt §II-A, Fig. 3): SDXL UNet throughput gain from batching, 3.31x at
# 512 px and 1.21x at 1024 px. The GPU and batch range are not stated. Assumed: batch 1 -> 8
# requests (§IV-A2 sets BS=8 as the maximum batch) with CFG on, i.e. rows 2 -> 16.
SYNERDIFF_GAIN = {512: 3.31, 1024: 1.21}
SYNERDIFF_ROWS = (2, 16)

# FLOPs (GFLOP) counted here with torch.utils.flop_counter.FlopCounterMode on the SDXL configs
# in engine/families/sdxl.py (FULL preset, meta tensors): UNet per row (with SDXL's added
# text_embeds/time_ids conditioning), VAE decode of one image, each text encoder per 77-token
# text. `--recount` reproduces them. 2 rows x 50 steps x 6761.24 = 676.1 TFLOP per 1024 px
# image, InstGenIE's (instgenie.txt §1) "676T FLOPs".
UNET_GFLOP = {512: 1588.78, 768: 3641.21, 1024: 6761.24}
VAE_GFLOP = {512: 2514.52, 768: 5754.30, 1024: 10470.39}
CLIP_GFLOP = {"clip-l": 13.30, "openclip-bigg": 97.86}
CLIP_LAYERS = {"clip-l": 12, "openclip-bigg": 32}

# derive_sd15_a100.py's rules, restated from their published inputs (see README.md there):
# the eager A100 SD1.5 step is 1000 / 21.66 ms at 2 rows and rises 10.11 ms per row at 512 px
# (diffusers torch2.0 benchmark, it/s 11.6 at batch 4 and 3.04 at batch 16); NVIDIA's TensorRT
# SD1.5 breakdown puts CLIP at 4 / 15.84 and VAE at 19 / 15.84 of one UNet step.
SD15_STEP_2_ROWS_MS = 1000 / 21.66
SD15_MS_PER_ROW = (1000 / 3.04 - 1000 / 11.6) / (32 - 8)
SD15_UNET_512_GFLOP = 803.27
SD15_CLIP_CALL_MS = 4.0 / (792 / 50) * SD15_STEP_2_ROWS_MS  # 11.66 ms, one CLIP-L call
SD15_VAE_512_MS = 19.0 / (792 / 50) * SD15_STEP_2_ROWS_MS  # 55.38 ms, fp16
# The decoder's FLOP rate as a share of the UNet's saturated rate (0.57): memory-bound, as
# SynerDiff's roofline (§II-A, Fig. 4) finds on the H800 too.
VAE_SHARE_OF_UNET_RATE = (VAE_GFLOP[512] / SD15_VAE_512_MS) / (SD15_UNET_512_GFLOP / SD15_MS_PER_ROW)
VAE_FP32_SLOWDOWN = 2.0  # assumption: force_upcast decodes in float32 (see the docstring)

# encode_png (PIL, compress_level=1) of smooth 512/768/1024 px images: 283/272/273 ms per
# megapixel, median of 9, on the 2-core Xeon VM this repo is developed on (under load); the
# same constant as derive_sd15_a100.py.
PNG_MS_PER_MPX = 275.0

# InstGenIE (instgenie.txt §6.6; §6.1 serves its SDXL and Flux on H800s): per denoising step,
# batching takes 1.2 ms; per request, scheduling 0.6 ms, latent serialization 1.1 ms and
# communication 1.3 ms.
ROUND_FIXED_MS = 1.2
REQUEST_OVERHEAD_MS = 0.6 + 1.1 + 1.3

# Add-ons, counted as above (`--recount`): a ControlNet (SDXL's config less the up blocks) per row;
# the UNet's down + mid blocks per row; the unmerged LoRA update FLOPs per row per unit of rank
# on to_q/to_k/to_v/to_out.0 (2 * tokens * rank * (in + out) per layer); one row's residuals in fp16.
CONTROLNET_GFLOP = {512: 712.09, 768: 1628.37, 1024: 3020.38}
ENCODER_GFLOP = {512: 690.13, 768: 1578.97, 1024: 2932.58}
LORA_GFLOP_PER_RANK = {512: 0.6989, 768: 1.4854, 1024: 2.5864}
RESIDUAL_MIB = {512: 12.81, 768: 28.83, 1024: 51.25}
LORA_RANK = 128
LORA_RATE_SHARE = 0.5  # assumption: low-rank GEMMs run at half the UNet's saturated FLOP rate
NVLINK_CALL_MS, NVLINK_BYTES_PER_MS = 0.1, 200e9 / 1e3
LORA_FILE_MIB = 341  # SwiftDiffusion §4.2's LoRA
PCIE_BYTES_PER_MS = 25e9 / 1e3  # host to device, PCIe 4.0 x16

SIZES = (512, 768, 1024)
BATCHES = tuple(range(1, 17))
TEXTS = (1, 2, 4, 8, 16, 32)

SWIFT = "SwiftDiffusion 2.9 s SDXL 1024px 50-step CFG solo on H800"
SYNER = "SynerDiff batching gains 3.31x/1.21x"
DERIVED = "derived, not measured; see configs/profiles/README.md"


def work(size: int, rows: float) -> float:
    """A forward's work in 512 px rows."""
    return rows * UNET_GFLOP[size] / UNET_GFLOP[512]


def _shape(w: float, n: float, knee: float) -> float:
    return (w**n + knee**n) ** (1 / n)


def _gain(size: int, n: float, knee: float) -> float:
    lo, hi = SYNERDIFF_ROWS
    return (hi / lo) * _shape(work(size, lo), n, knee) / _shape(work(size, hi), n, knee)


def _bisect(f, lo: float, hi: float) -> float:
    """The root of f between lo and hi, where f changes sign."""
    f_lo = f(lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) > 0) == (f_lo > 0):
            lo, f_lo = mid, f(mid)
        else:
            hi = mid
    return (lo + hi) / 2


def solve_shape() -> tuple[float, float]:
    """(n, X) such that the batching gains match SynerDiff's at both sizes. For a given n the
    512 px gain grows with X (a larger knee means more room to batch), which fixes X; the
    1024 px gain then falls as n grows (a sharper knee), which fixes n."""
    def knee_for(n: float) -> float:
        return _bisect(lambda knee: _gain(512, n, knee) - SYNERDIFF_GAIN[512], 1e-3, 1e3)

    n = _bisect(lambda n: _gain(1024, n, knee_for(n)) - SYNERDIFF_GAIN[1024], 1.0, 20.0)
    return n, knee_for(n)


N, KNEE = solve_shape()


def relative_step(size: int, rows: float) -> float:
    """A forward's time in units of T (the ms per 512 px row once the GPU is saturated)."""
    return _shape(work(size, rows), N, KNEE)


def _gpu_ms_per_gflop(t_ms: float) -> float:
    return t_ms / UNET_GFLOP[512]  # the UNet's saturated rate, ms per GFLOP


def _text_ms(texts: int, t_ms: float) -> float:
    first = SD15_CLIP_CALL_MS * sum(CLIP_LAYERS.values()) / CLIP_LAYERS["clip-l"]
    return first + (texts - 1) * sum(CLIP_GFLOP.values()) * _gpu_ms_per_gflop(t_ms)


def _vae_gpu_ms(size: int, t_ms: float) -> float:
    return VAE_FP32_SLOWDOWN * VAE_GFLOP[size] * _gpu_ms_per_gflop(t_ms) / VAE_SHARE_OF_UNET_RATE


def solve_scale() -> float:
    """T: the anchor request (text encode of 2 texts, ANCHOR_STEPS rounds, GPU decode, request
    overhead; no PNG) takes ANCHOR_MS. Every term but the fixed ones is linear in T."""
    def solo_without_png(t_ms: float) -> float:
        step = t_ms * relative_step(ANCHOR_SIZE, 2) + ROUND_FIXED_MS
        return _text_ms(2, t_ms) + ANCHOR_STEPS * step + _vae_gpu_ms(ANCHOR_SIZE, t_ms) + REQUEST_OVERHEAD_MS

    fixed = solo_without_png(0.0)
    return (ANCHOR_MS - fixed) / (solo_without_png(1.0) - fixed)


T_MS = solve_scale()


def denoise_ms(size: int, rows: int) -> float:
    return T_MS * relative_step(size, rows)


def controlnet_ms(size: int, rows: int) -> float:
    # Its blocks are the UNet's encoder blocks at the same tokens and rows, so they run as
    # efficiently as the UNet's: time in proportion to FLOPs at the same rows.
    return denoise_ms(size, rows) * CONTROLNET_GFLOP[size] / UNET_GFLOP[size]


def encoder_ms(size: int, rows: int) -> float:
    return denoise_ms(size, rows) * ENCODER_GFLOP[size] / UNET_GFLOP[size]


def transfer_ms(size: int, rows: int) -> float:
    return NVLINK_CALL_MS + rows * RESIDUAL_MIB[size] * 2**20 / NVLINK_BYTES_PER_MS


def cfg_exchange_ms(size: int, rows: int) -> float:
    """A CFG split's all-gather of the two rows' noise predictions (4 latent channels, fp16)."""
    return NVLINK_CALL_MS / 2 + rows * 4 * (size // 8) ** 2 * 2 / NVLINK_BYTES_PER_MS


def lora_ms(size: int, rows: int) -> float:
    return rows * LORA_RANK * LORA_GFLOP_PER_RANK[size] * _gpu_ms_per_gflop(T_MS) / LORA_RATE_SHARE


def text_encode_ms(texts: int) -> float:
    return _text_ms(texts, T_MS)


def png_ms(size: int) -> float:
    return PNG_MS_PER_MPX * size * size / 1e6


def vae_decode_ms(size: int) -> float:
    return _vae_gpu_ms(size, T_MS) + png_ms(size)


def rows() -> list[ProfileRow]:
    def row(component, ms, source, height=0, width=0, n=1):
        return ProfileRow(MODEL, DEVICE, component, height, width, n, 1, ms, 1, f"{source}; {DERIVED}")

    out = []
    for size in SIZES:
        for n in sorted({b for b in BATCHES} | {2 * b for b in BATCHES}):
            out.append(row(DENOISE, denoise_ms(size, n), f"{SWIFT} x {SYNER} x UNet FLOP ratio", size, size, n))
            out.append(row(CONTROLNET, controlnet_ms(size, n), "denoise x counted ControlNet/UNet FLOP ratio", size,
                           size, n))
            out.append(row(DENOISE_ENCODER, encoder_ms(size, n), "denoise x counted down+mid FLOP share", size,
                           size, n))
            out.append(row(CONTROLNET_TRANSFER, transfer_ms(size, n), "counted residual bytes over NVLink", size,
                           size, n))
            out.append(row(LORA, lora_ms(size, n), f"rank {LORA_RANK} counted FLOPs at half the UNet rate", size,
                           size, n))
        out.append(row(CFG_EXCHANGE, cfg_exchange_ms(size, 2), "latent bytes over NVLink", size, size, 2))
        out.append(row(VAE_DECODE, vae_decode_ms(size),
                       "SD1.5 VAE share of UNet rate (TensorRT ratio) x2 fp32 x VAE FLOPs + PNG measured on CPU",
                       size, size))
    for n in TEXTS:
        out.append(row(TEXT_ENCODE, text_encode_ms(n), "SD1.5 CLIP-L call x layers (12+32)/12 + CLIP FLOPs", n=n))
    out.append(row(ROUND_OVERHEAD, ROUND_FIXED_MS, "InstGenIE §6.6 per-step batching cost"))
    out.append(row(REQUEST_OVERHEAD, REQUEST_OVERHEAD_MS, "InstGenIE §6.6 scheduling + serialization + communication"))
    out.append(row(LORA_LOAD, LORA_FILE_MIB * 2**20 / PCIE_BYTES_PER_MS, "341 MiB LoRA host to device over PCIe 4.0"))
    return out


def summary() -> None:
    """The derived constants and the consistency checks README.md quotes."""
    print(f"shape n = {N:.3f}, knee X = {KNEE:.3f} rows at 512 px; T = {T_MS:.3f} ms per 512 px row "
          f"({UNET_GFLOP[512] / T_MS:.0f} TFLOP/s saturated)")
    for size in SIZES:
        print(f"  {size} px: gain rows 2->16 {_gain(size, N, KNEE):.3f}x; step 1/2/4/32 rows "
              + " / ".join(f"{denoise_ms(size, r):.2f}" for r in (1, 2, 4, 32)) + " ms; "
              f"decode GPU {_vae_gpu_ms(size, T_MS):.1f} + PNG {png_ms(size):.1f} ms")
    print("  text_encode 1/2/32: " + " / ".join(f"{text_encode_ms(n):.2f}" for n in (1, 2, 32)) + " ms")
    step = denoise_ms(1024, 2)
    print(f"  1024 px CFG request: ControlNet {controlnet_ms(1024, 2):.2f} ms, encoder half {encoder_ms(1024, 2):.2f} ms, "
          f"residuals {transfer_ms(1024, 2):.2f} ms, LoRA {lora_ms(1024, 2):.2f} ms ({lora_ms(1024, 2) / step:.1%})")
    split = denoise_ms(1024, 1) + cfg_exchange_ms(1024, 2)
    print(f"  1024 px CFG split over two GPUs: {split:.2f} ms a step, x{step / split:.3f} (paper: 1.36x on the H800)")
    print(f"  1024 px CFG step {step:.2f} ms = {2 * UNET_GFLOP[1024] / step:.0f} TFLOP/s; "
          f"rows 1->2 x{step / denoise_ms(1024, 1):.3f}, 2->4 x{denoise_ms(1024, 4) / step:.3f}, "
          f"4->8 x{denoise_ms(1024, 8) / denoise_ms(1024, 4):.3f}")


def recount() -> None:
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from stepserve.engine.families.presets import autoencoder_kl, clip_text_config
    from stepserve.engine.families.sdxl import FULL

    def gflop(fn) -> float:
        with FlopCounterMode(display=False) as mode, torch.no_grad():
            fn()
        return mode.get_total_flops() / 1e9

    with torch.device("meta"):
        unet = UNet2DConditionModel(in_channels=4, out_channels=4, **FULL["unet"]).eval()
        vae = autoencoder_kl(FULL["vae"]).eval()
        clip_l = CLIPTextModel(clip_text_config(FULL["text"])).eval()
        clip_g = CLIPTextModelWithProjection(clip_text_config(FULL["text_2"])).eval()
        context = torch.empty(1, 77, 2048)  # both encoders' hidden states, concatenated
        added = {"text_embeds": torch.empty(1, 1280), "time_ids": torch.empty(1, 6)}
        for size in SIZES:
            latents = torch.empty(1, 4, size // 8, size // 8)
            unet_gflop = gflop(lambda: unet(latents, torch.tensor([500.0]), context, added_cond_kwargs=added))
            vae_gflop = gflop(lambda: vae.decode(latents))
            print(f"{size}px: UNet/row {unet_gflop:.2f} GFLOP, VAE decode {vae_gflop:.2f} GFLOP")
            recount_addons(unet, latents, context, added, size)
        tokens = torch.zeros(1, 77, dtype=torch.long)
        print(f"CLIP-L text encoder: {gflop(lambda: clip_l(tokens)):.2f} GFLOP per text; "
              f"OpenCLIP-bigG: {gflop(lambda: clip_g(tokens)):.2f} GFLOP per text")


def recount_addons(unet, latents, context, added, size: int) -> None:
    import torch
    from diffusers import ControlNetModel
    from torch.utils.flop_counter import FlopCounterMode

    config = {k: v for k, v in FULL_UNET().items() if k not in ("up_block_types", "sample_size")}
    with torch.device("meta"):
        controlnet = ControlNetModel(in_channels=4, **config).eval()
    timestep = torch.tensor([500.0])
    with FlopCounterMode(display=False) as mode, torch.no_grad():
        unet(latents, timestep, context, added_cond_kwargs=added)
    counts = mode.get_flop_counts()
    encoder = sum(sum(v.values()) for k, v in counts.items()
                  if k == "UNet2DConditionModel.mid_block" or (k.startswith("UNet2DConditionModel.down_blocks.")
                                                               and k.count(".") == 2))
    lora = sum(sum(counts.get(f"UNet2DConditionModel.{name}", {}).values()) * (m.in_features + m.out_features)
               / (m.in_features * m.out_features) for name, m in unet.named_modules()
               if isinstance(m, torch.nn.Linear) and name.endswith(("to_q", "to_k", "to_v", "to_out.0")))
    with FlopCounterMode(display=False) as mode, torch.no_grad():
        down, mid = controlnet(latents, timestep, encoder_hidden_states=context,
                               controlnet_cond=torch.empty(1, 3, size, size), added_cond_kwargs=added, return_dict=False)
    residual = sum(t.numel() for t in [*down, mid]) * 2
    print(f"  ControlNet/row {mode.get_total_flops() / 1e9:.2f} GFLOP, UNet down+mid/row {encoder / 1e9:.2f} GFLOP, "
          f"LoRA/row/rank {lora / 1e9:.4f} GFLOP, residuals/row {residual / 2**20:.2f} MiB")


def FULL_UNET() -> dict:
    from stepserve.engine.families.sdxl import FULL

    return dict(FULL["unet"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recount", action="store_true", help="recount the FLOPs instead of writing the CSV")
    args = parser.parse_args()
    if args.recount:
        recount()
        return
    write_profile(OUT, rows())
    summary()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
