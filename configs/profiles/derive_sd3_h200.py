"""Writes sd3-h200.csv: SD3.5-Medium (full size, random weights, float16) on one NVIDIA H200, its
forwards MEASURED and its text encoding and decode DERIVED. README.md in this folder says so too.

    python configs/profiles/derive_sd3_h200.py     # rewrite sd3-h200.csv

`stepserve profile --model stable-diffusion-3.5-medium` ran on one H200 (tests/gpu/device_check.sh,
STEPS=profiles, 2026-11-28) and was stopped at its step's time limit after it had timed every
forward but before it timed text encoding and decode and wrote its CSV; the device was not lent
again that session. Its log (docs/results/profiles-h200/sd3-h200.log) holds every median it
measured, as `stepserve profile` prints them. This script turns those lines into the rows the
profiler would have written (the same components, shapes and notes):

- denoise: `family.denoise` at 512/768/1024 px, rows 1-16;
- denoise with mask_ratio < 1: `template_forward` over cached block outputs (the cluster's
  `edit_cache.cache: outputs`), loads included, 1/4/8 CFG edits at mask ratios 0.1/0.2/0.5;
- packed denoise (groups): `family.denoise_mixed` of every mix of the sizes, 1/2/4 CFG requests each;
- round_overhead: `StepRunner.execute` minus its forwards (all but one point, which the stop cut).

Derived, not measured (say "derived" in their source, so nothing that trains on measured rows
takes them):

- text_encode: SD3 runs CLIP-L and OpenCLIP bigG (SDXL's two encoders, measured on the same H200
  in sdxl-h200.csv) plus T5-XXL's encoder, the same layer shapes as Wan's umT5-XXL (measured in
  wan22-ti2v-h200.csv at Wan's 512 tokens) at SD3's 256 tokens: the umT5 line (least squares over
  its 1/2/4-text points) at half the tokens, added to SDXL's row of as many texts.
- vae_decode: SDXL's measured decode + PNG at the same size: SD3's VAE decoder has SDXL's layout
  (128-512 channels, 2 layers per block; only its 16 latent channels differ), and SDXL's decodes
  in float32 (force_upcast) where SD3's runs in float16, so this is an upper bound.
- block_cached, block_full, block_load (the loading DP's C_w, C_wo, L per transformer block):
  measured on an H100 for sd3-medium's transformer at 1024 px, one CFG edit (2 rows), bfloat16,
  over a record pinned in host memory (`bench_cache_loading`, docs/results/cache-loading-h100);
  the H200 has the H100's compute and more memory bandwidth, its host link the same PCIe. So the
  workers plan single edits at 1024 px with them; other shapes load every block (unplanned).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from stepserve.policies.cost_model import (BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD, DENOISE, ROUND_OVERHEAD, TEXT_ENCODE,
                                           VAE_DECODE, ProfileRow, read_profile, write_profile)

HERE = Path(__file__).resolve().parent
LOG = HERE.parents[1] / "docs" / "results" / "profiles-h200" / "sd3-h200.log"
H100_BLOCKS = HERE.parents[1] / "docs" / "results" / "cache-loading-h100" / "cache_loading.json"
MODEL, DEVICE = "stable-diffusion-3.5-medium", "cuda"
MEASURED = "measured 2026-11-28 NVIDIA H200, torch 2.11.0+cu130"
FROM_LOG = "read from its run's log (stopped before it wrote this CSV)"
THREADS = "16 thread(s)"
REPEATS = 5  # --repeats 5
T5_TOKEN_SHARE = 256 / 512  # SD3's T5 max_sequence_length over Wan's

DENOISE_LINE = re.compile(r"^  (\d+)px rows (\d+): ([\d.]+) ms$")
MASKED_LINE = re.compile(r"^  (\d+)px rows (\d+) mask ([\d.]+): ([\d.]+) ms$")
PACKED_LINE = re.compile(r"^  ([\d+]+)px rows (\d+) each: packed ([\d.]+) ms, in turn ([\d.]+) ms")
OVERHEAD_LINE = re.compile(r"^  (\d+)px batch (\d+) cfg (on|off) \(rows (\d+)\): ([\d.]+) ms$")


def measured(component: str, ms: float, size: int, rows: int, note: str, **extra) -> ProfileRow:
    return ProfileRow(MODEL, DEVICE, component, size, size, rows, 1, ms, REPEATS,
                      f"{MEASURED}; {note}, {THREADS}; {FROM_LOG}", **extra)


def rows_from_log(lines: list[str]) -> list[ProfileRow]:
    out = []
    section = ""
    for line in lines:
        if line.startswith("["):
            section = line.split("]")[0] + "]"
        elif section == "[denoise]" and (m := DENOISE_LINE.match(line)):
            size, rows, ms = int(m[1]), int(m[2]), float(m[3])
            out.append(measured(DENOISE, ms, size, rows, "family.denoise"))
        elif section == "[denoise, masked]" and (m := MASKED_LINE.match(line)):
            size, rows, share, ms = int(m[1]), int(m[2]), float(m[3]), float(m[4])
            out.append(measured(DENOISE, ms, size, rows, f"template_forward over cached outputs, loads included, "
                                f"{rows // 2} edit(s) of 2 row(s)", mask_ratio=share))
        elif section == "[denoise, packed]" and (m := PACKED_LINE.match(line)):
            sizes, rows, ms, in_turn = [int(s) for s in m[1].split("+")], int(m[2]), float(m[3]), float(m[4])
            out.append(measured(DENOISE, ms, max(sizes), rows * len(sizes),
                                f"family.denoise_mixed of {m[1]} px; the same groups in turn {in_turn:.3f} ms",
                                groups=tuple((s, s, rows) for s in sizes)))
        elif section == "[round_overhead]" and (m := OVERHEAD_LINE.match(line)):
            size, batch, cfg, rows, ms = int(m[1]), int(m[2]), m[3], int(m[4]), float(m[5])
            out.append(measured(ROUND_OVERHEAD, ms, size, rows,
                                f"StepRunner.execute minus family.denoise, batch {batch} cfg {cfg}"))
    return out


def derived_text_and_decode() -> list[ProfileRow]:
    sdxl = read_profile(HERE / "sdxl-h200.csv")
    wan = read_profile(HERE / "wan22-ti2v-h200.csv")
    umt5 = sorted((r.rows, r.latency_ms) for r in wan if r.component == TEXT_ENCODE)
    slope, intercept = statistics.linear_regression([n for n, _ in umt5], [ms for _, ms in umt5])
    out = []
    for clip in (r for r in sdxl if r.component == TEXT_ENCODE):
        t5 = T5_TOKEN_SHARE * (intercept + slope * clip.rows)
        out.append(ProfileRow(MODEL, DEVICE, TEXT_ENCODE, 0, 0, clip.rows, 1, clip.latency_ms + t5, 1,
                              f"derived: sdxl-h200's measured CLIP-L + bigG call of {clip.rows} text(s) "
                              f"({clip.latency_ms:.1f} ms) + T5-XXL at 256 tokens, wan22-ti2v-h200's measured "
                              f"umT5-XXL line at 512 tokens x {T5_TOKEN_SHARE:g} ({t5:.1f} ms)"))
    for decode in (r for r in sdxl if r.component == VAE_DECODE):
        out.append(ProfileRow(MODEL, DEVICE, VAE_DECODE, decode.height, decode.width, 1, 1, decode.latency_ms, 1,
                              "derived: sdxl-h200's measured decode + PNG at this size (the same VAE decoder "
                              "layout; SDXL's in float32, SD3's in float16: an upper bound)"))
    return out


def derived_block_costs() -> list[ProfileRow]:
    bench = json.loads(H100_BLOCKS.read_text())
    size, rows, results = bench["image_size"], bench["rows"], bench["results"]
    source = (f"derived: measured on an {bench['device']} ({bench['dtype']}, {bench['config']}'s transformer, "
              f"{bench['cost_repeats']} repeats; docs/results/cache-loading-h100)")

    def row(component: str, seconds: float, slot: int, share: float = 1.0) -> ProfileRow:
        return ProfileRow(MODEL, DEVICE, component, size, size, rows, 1, 1e3 * seconds, bench["cost_repeats"],
                          source, mask_ratio=share, slot=slot)

    first = results[0]["costs"]  # C_wo and L do not depend on the mask
    out = [row(BLOCK_FULL, c, slot) for slot, c in enumerate(first["c_without"])]
    out += [row(BLOCK_LOAD, c, slot) for slot, c in enumerate(first["load"])]
    for result in results:
        out += [row(BLOCK_CACHED, c, slot, result["token_ratio"]) for slot, c in enumerate(result["costs"]["c_with"])]
    return out


def main() -> None:
    rows = rows_from_log(LOG.read_text().splitlines()) + derived_text_and_decode() + derived_block_costs()
    write_profile(HERE / "sd3-h200.csv", rows)
    print(f"wrote {len(rows)} rows to {HERE / 'sd3-h200.csv'}")


if __name__ == "__main__":
    main()
