"""ControlNet parallelism at GPU magnitude (SwiftDiffusion §4.1, §6.3): one request's denoising
step with m ControlNets run before the UNet (sequential, diffusers) against the ControlNets on
their own devices while the UNet's encoder half runs (`controlnet_service`), and the ideal.

Where the time goes comes from the models themselves: the FLOPs of the UNet's down blocks, mid
block and up blocks and of a ControlNet, counted on the meta device (torch's FlopCounterMode) for
the full-size configs, scaled to the profile's measured-or-derived step time (time taken as
proportional to FLOPs). The residuals a ControlNet sends back are counted too, and priced by a
transport: `nvlink` (device to device, SwiftDiffusion's setup), `host` (what the service does
today: device to host, through Ray's object store, host to device) or `stale` (one step stale:
the residuals of the previous step, computed during it, so transport and ControlNet hide behind a
whole UNet step; an approximation, `controlnet_service.stale`).

    python -m stepserve.load_tests.bench_controlnet_parallel --out docs/results/controlnet-parallel

The ideal is the critical path with free communication, max(encoder + mid, ControlNet) +
decoder; the paper's Gustafson figures (1.45x for one ControlNet, 2.35x for three) are printed
beside it. Writes controlnet_parallel.json and controlnet_parallel.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

from stepserve.engine.addons.presets import UNET_PRESETS
from stepserve.engine.families.presets import preset_config
from stepserve.load_tests.plots import plot_controlnet_parallel
from stepserve.policies.cost_model import BatchShape, load_profile

PAPER = {1: (1.42, 1.45), 3: (2.2, 2.35)}  # m ControlNets: (achieved, Gustafson ideal)


@dataclass(frozen=True)
class Transport:
    name: str
    latency_s: float  # per call
    bytes_per_s: float  # effective, for the residuals' bytes
    hides_behind_step: bool = False  # stale: overlaps a whole UNet step


TRANSPORTS = (
    Transport("nvlink", 0.1e-3, 200e9),
    # device->host (PCIe 4.0 x16 ~25 GB/s), object store copy and pickle (~5 GB/s), host->device:
    # 1 / (1/25 + 1/5 + 1/25) GB/s; a Serve call ~1 ms.
    Transport("host", 1e-3, 1 / (1 / 25e9 + 1 / 5e9 + 1 / 25e9)),
    Transport("stale", 1e-3, 1 / (1 / 25e9 + 1 / 5e9 + 1 / 25e9), hides_behind_step=True),
)


@dataclass(frozen=True)
class Shares:
    down: float  # of the UNet's FLOPs (conv_in, embeddings and conv_out are in none: < 0.1%)
    mid: float
    up: float
    controlnet: float  # one ControlNet's FLOPs over the UNet's
    residual_bytes: int  # one ControlNet's residuals for the rows, at the model's dtype
    unet_tflops: float


def shares(family: str, preset: str, size: int, rows: int, dtype_bytes: int = 2) -> Shares:
    unet_cfg = dict(preset_config(UNET_PRESETS[family], preset, family)["unet"])
    cn_cfg = {k: v for k, v in unet_cfg.items() if k not in ("up_block_types", "sample_size")}
    side = size // 8
    with torch.device("meta"):
        unet = UNet2DConditionModel(in_channels=4, out_channels=4, **unet_cfg)
        controlnet = ControlNetModel(in_channels=4, **cn_cfg)
        sample, timesteps = torch.randn(rows, 4, side, side), torch.full((rows,), 500.0)
        context = torch.randn(rows, 77, unet_cfg["cross_attention_dim"])
        extra = {}
        if unet_cfg.get("addition_embed_type") == "text_time":
            pooled = unet_cfg["projection_class_embeddings_input_dim"] - 6 * unet_cfg["addition_time_embed_dim"]
            extra = {"added_cond_kwargs": {"text_embeds": torch.randn(rows, pooled), "time_ids": torch.randn(rows, 6)}}
        image = torch.randn(rows, 3, size, size)
    with FlopCounterMode(display=False) as unet_flops:
        unet(sample, timesteps, encoder_hidden_states=context, **extra)
    with FlopCounterMode(display=False) as cn_flops:
        down, mid = controlnet(sample, timesteps, encoder_hidden_states=context, controlnet_cond=image,
                               return_dict=False, **extra)
    counts = unet_flops.get_flop_counts()
    total = sum(counts["Global"].values())

    def part(prefix: str) -> float:
        return sum(sum(v.values()) for k, v in counts.items() if k.startswith(prefix) and k.count(".") == 2) / total

    residual = sum(t.numel() for t in [*down, mid]) * dtype_bytes
    return Shares(part("UNet2DConditionModel.down_blocks."), sum(counts["UNet2DConditionModel.mid_block"].values())
                  / total, part("UNet2DConditionModel.up_blocks."), sum(cn_flops.get_flop_counts()["Global"].values())
                  / total, residual, total / 1e12)


def step_times(s: Shares, unet_s: float, m: int, transport: Transport) -> dict[str, float]:
    encoder, decoder, cn = (s.down + s.mid) * unet_s, s.up * unet_s, s.controlnet * unet_s
    comm = transport.latency_s + s.residual_bytes / transport.bytes_per_s
    sequential = unet_s + m * cn
    ideal = max(encoder, cn) + decoder
    if transport.hides_behind_step:
        parallel = max(unet_s, cn + comm)  # previous step's residuals are already here
    else:
        parallel = max(encoder, cn + comm) + decoder  # each ControlNet on its own device, at once
    return {"sequential_s": sequential, "ideal_s": ideal, "parallel_s": parallel, "comm_s": comm,
            "speedup": sequential / parallel, "ideal_speedup": sequential / ideal,
            "of_ideal": (sequential / parallel) / (sequential / ideal)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_controlnet_parallel",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="sdxl", choices=sorted(UNET_PRESETS))
    parser.add_argument("--profile", default="sdxl-h800")
    parser.add_argument("--model", default="stable-diffusion-xl-base-1.0", help="the profile's model name")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = 2  # one request under CFG, as the paper serves it (batch size 1)
    s = shares(args.family, "full", args.size, rows)
    unet_s = load_profile(args.profile).denoise_seconds(BatchShape(args.model, args.size, args.size, rows))
    results = [{"controlnets": m, "transport": t.name, **step_times(s, unet_s, m, t)}
               for m in (1, 2, 3) for t in TRANSPORTS]
    report = {"benchmark": "controlnet_parallel", "family": args.family, "size": args.size, "rows": rows,
              "profile": args.profile, "unet_step_s": unet_s, "shares": asdict(s),
              "transports": [asdict(t) for t in TRANSPORTS], "results": results,
              "paper": {str(m): {"achieved": a, "ideal": i} for m, (a, i) in PAPER.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "controlnet_parallel.json").write_text(json.dumps(report, indent=1))
    plot_controlnet_parallel(report, args.out / "controlnet_parallel.png")
    print(f"UNet step {unet_s * 1000:.1f} ms; FLOP shares down {s.down:.3f} mid {s.mid:.3f} up {s.up:.3f}; "
          f"ControlNet {s.controlnet:.3f} of the UNet; residuals {s.residual_bytes / 2**20:.1f} MiB")
    for r in results:
        paper = PAPER.get(r["controlnets"])
        versus = f"; paper {paper[0]}x of {paper[1]}x" if paper else ""
        print(f"{r['controlnets']} ControlNet(s), {r['transport']:<6}: speedup {r['speedup']:.2f}x of ideal "
              f"{r['ideal_speedup']:.2f}x ({r['of_ideal']:.0%}){versus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
