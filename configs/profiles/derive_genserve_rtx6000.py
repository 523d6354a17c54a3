"""Writes genserve-rtx6000.csv: a GPU-magnitude profile of GenServe's image + video setting (SD3.5
text-to-image and Wan2.2-5B text-to-video on one RTX PRO 6000 per worker), DERIVED from the
figures in ../shared/papers/genserve-slides.txt. Nothing here was measured on that GPU.

    python configs/profiles/derive_genserve_rtx6000.py

Rules (every constant below names its source):
- Video denoise at SP degree 1 scales with the DiT FLOPs per step of Table 3 (Wan2.2, 81
  frames: 10.81 / 43.90 / 145.26 TFLOPs at 256p / 480p / 720p), anchored at Table 7's 720p
  base step of 781.57 ms. Table 3's sequence lengths (1,344 / 4,725 / 12,096 tokens = 21 latent
  frames x 8², 15², 24² patches) say the three resolutions are 256, 480 and 768 px squares.
  Only 81 frames is profiled (Table 3 gives no other frame count); the cost model
  extrapolates other counts by pixels x frames.
- SP degree d: t_d = t_1 / d + k * tokens * (d - 1) / d² (the all-to-all volume each rank
  sends). k is fitted so that 720p at SP 8 is 7.0x faster than SP 1 (Fig. 5, "up to 7.0x");
  it then puts 256p's communication share at SP 8 near the 20% of Fig. 6.
- Rows: the anchor step runs classifier-free guidance (2 rows); 1 row costs half.
- Image denoise (SD3.5): Table 3's FLOPs per step (0.36 / 1.34 / 3.91 TFLOPs at 256 / 480 /
  768 px; 1024 px extrapolated at the 768 px FLOPs per token growth) at the same effective
  FLOP rate as the video anchor, plus a fixed per-forward floor that makes low-resolution
  batching nearly free, as Fig. 3 shows.
- VAE decode, text encode and overheads are assumptions of magnitude (the slides give no
  numbers); each is stated below. Video decode runs on one worker whatever the SP degree
  (Fig. 5: "VAE Decode latency is unaffected by SP degree").
"""

from __future__ import annotations

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

DEVICE = "rtx-pro-6000"
OUT = Path(__file__).with_name("genserve-rtx6000.csv")
IMAGE_MODEL = "sd3.5-medium"
VIDEO_MODEL = "wan2.2-5b"
SOURCE = "GenServe slides ({}); derived, not measured; see configs/profiles/derive_genserve_rtx6000.py"

# Table 3 and Table 7.
VIDEO_TFLOPS = {256: 10.81, 480: 43.90, 768: 145.26}  # per step, 81 frames
VIDEO_TOKENS = {256: 1344, 480: 4725, 768: 12096}  # 81 frames = 21 latent frames
ANCHOR_MS = 781.57  # 720p (768 px), SP 1, Table 7
SP8_SPEEDUP_768 = 7.0  # Fig. 5
IMAGE_TFLOPS = {256: 0.36, 480: 1.34, 768: 3.91}
IMAGE_TOKENS = {256: 256, 480: 900, 768: 2304}
# Assumptions of magnitude (no figure in the slides):
IMAGE_FLOOR_MS = 8.0  # per forward: ~24 DiT blocks of kernel launches at tiny sequence lengths
VIDEO_DECODE_768_81_MS = 4000.0  # Wan VAE, 81 frames at 768 px, plus MP4 encoding
IMAGE_DECODE_768_MS = 60.0  # SD3.5 VAE at 768 px plus PNG encoding
TEXT_MS = {IMAGE_MODEL: 25.0, VIDEO_MODEL: 20.0}  # CLIP-L/G + T5-XXL; UMT5-XXL; per call
TEXT_MS_PER_EXTRA_TEXT = 4.0
ROUND_FIXED_MS = 1.0  # the plan/report RPC per worker round (InstGenIE §6.6 magnitude)
REQUEST_OVERHEAD_MS = 10.0  # HTTP, ingress and hops per request


def _row(model: str, component: str, height: int, width: int, rows: int, frames: int, ms: float, what: str,
         sp_degree: int = 1) -> ProfileRow:
    return ProfileRow(model, DEVICE, component, height, width, rows, frames, round(ms, 4), 1, SOURCE.format(what),
                      sp_degree)


def video_rows() -> list[ProfileRow]:
    ms_per_tflop = ANCHOR_MS / VIDEO_TFLOPS[768]
    t1_768 = ANCHOR_MS
    # t1/8 + k * tokens * 7/64 = t1 / 7
    k = (t1_768 / SP8_SPEEDUP_768 - t1_768 / 8) / (VIDEO_TOKENS[768] * 7 / 64)
    out = []
    for size, tflops in VIDEO_TFLOPS.items():
        t1 = tflops * ms_per_tflop
        for d in (1, 2, 4, 8):
            td = t1 / d + k * VIDEO_TOKENS[size] * (d - 1) / d**2
            for rows, factor in ((2, 1.0), (1, 0.5)):
                out.append(_row(VIDEO_MODEL, DENOISE, size, size, rows, 81, td * factor, "Tables 3, 7; Figs. 5, 6", d))
        decode = VIDEO_DECODE_768_81_MS * (size * size) / (768 * 768)
        out.append(_row(VIDEO_MODEL, VAE_DECODE, size, size, 1, 81, decode, "assumed magnitude"))
    return out


def image_rows() -> list[ProfileRow]:
    ms_per_tflop = ANCHOR_MS / VIDEO_TFLOPS[768]
    tflops = dict(IMAGE_TFLOPS)
    per_token = {s: IMAGE_TFLOPS[s] / IMAGE_TOKENS[s] for s in IMAGE_TFLOPS}
    growth = (per_token[768] - per_token[480]) / (IMAGE_TOKENS[768] - IMAGE_TOKENS[480])
    tflops[1024] = 4096 * (per_token[768] + growth * (4096 - IMAGE_TOKENS[768]))
    out = []
    for size, f in tflops.items():
        for rows in (1, 2, 4, 8, 16):
            out.append(_row(IMAGE_MODEL, DENOISE, size, size, rows, 1, IMAGE_FLOOR_MS + rows * f * ms_per_tflop,
                            "Table 3; Fig. 3"))
        out.append(_row(IMAGE_MODEL, VAE_DECODE, size, size, 1, 1, IMAGE_DECODE_768_MS * size * size / 768**2,
                        "assumed magnitude"))
    return out


def shared_rows() -> list[ProfileRow]:
    out = []
    for model, ms in TEXT_MS.items():
        for texts in (1, 2, 4, 8):
            out.append(_row(model, TEXT_ENCODE, 0, 0, texts, 1, ms + (texts - 1) * TEXT_MS_PER_EXTRA_TEXT,
                            "assumed magnitude"))
        out.append(_row(model, ROUND_OVERHEAD, 0, 0, 1, 1, ROUND_FIXED_MS, "assumed magnitude"))
        out.append(_row(model, REQUEST_OVERHEAD, 0, 0, 1, 1, REQUEST_OVERHEAD_MS, "assumed magnitude"))
    return out


def main() -> None:
    write_profile(OUT, video_rows() + image_rows() + shared_rows())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
