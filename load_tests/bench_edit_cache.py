"""Edits with cached activations vs full recompute, live (InstGenIE §3.1, §6.3): one app serving
an SD3-class model (`small` preset: compute, not overhead, dominates a CPU forward) with
`edit_cache` on, edited over HTTP exactly as clients do (`POST /v1/images/edits`, multipart).

An edit that names the template reuses its cached activations (recorded once by a first edit);
the same edit without `template_id` is recomputed in full, exact. At each mask ratio the two
alternate request by request with the same prompts, seeds and masks, so each cached image has
its exact twin: latency (one request at a time), throughput (a burst of concurrent requests,
batched), and fidelity (PSNR and SSIM of the cached image against its exact twin).

    python -m stepserve.load_tests.bench_edit_cache --out docs/results/edit-cache

Writes edit_cache.json and edit_cache.png.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib
import numpy as np
import PIL.Image
from prometheus_client.parser import text_string_to_metric_families

from stepserve.load_tests.fidelity import psnr, ssim
from stepserve.load_tests.edit_workload import mask_png, template_png
from stepserve.load_tests.live import wait_ready
from stepserve.load_tests.local_app import deployed, free_port, local_ray, log
from stepserve.load_tests.server_metrics import scrape_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = ("recompute", "cached")
TEMPLATE = "bench-template"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_edit_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="small", help="the SD3 preset served (default: %(default)s)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument("--sequential", type=int, default=3, help="latency: requests per mode and ratio")
    parser.add_argument("--burst", type=int, default=4, help="throughput: concurrent requests per mode and ratio")
    parser.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    return parser.parse_args(argv)


def serve_config(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """One worker (all the machine's cores) that encodes, denoises and decodes, with the cache on."""
    model = {"name": "bench-sd3", "family": "sd3", "preset": args.preset, "default_size": f"{args.size}x{args.size}",
             "max_size": args.size, "max_pixels": args.size * args.size, "default_steps": args.steps}
    app = {"models": [model], "workers": {"num_workers": 1, "max_batch_size": args.burst, "num_cpus": 1,
                                          "device": "cpu", "torch_threads": args.threads},
           "router": {"policy": "continuous"}, "text_encoder": {"on_workers": True},
           "vae_decoder": {"on_workers": True}, "ingress": {"num_cpus": 0.1},
           "edit_cache": {"enabled": True, "memory_bytes": 4 << 30}}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "stepserve", "route_prefix": "/",
                              "import_path": "stepserve.deployments.app:build_app", "args": app}]}


async def edit(client: httpx.AsyncClient, url: str, image: bytes, mask: bytes, seed: int,
               cached: bool) -> tuple[float, np.ndarray]:
    fields = {"prompt": f"a potted plant, variation {seed}", "seed": str(seed), "response_format": "b64_json"}
    if cached:
        fields["template_id"] = TEMPLATE
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/images/edits", data=fields,
                                 files={"image": ("image.png", image, "image/png"),
                                        "mask": ("mask.png", mask, "image/png")})
    latency = time.perf_counter() - started
    response.raise_for_status()
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    return latency, np.asarray(PIL.Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64) / 255.0


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    image = template_png(args.size, args.size, TEMPLATE)
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        # The first edit of the template records its activations; warm both paths up.
        await edit(client, url, image, mask_png(args.size, args.size, 0.2), seed=0, cached=True)
        await edit(client, url, image, mask_png(args.size, args.size, 0.2), seed=0, cached=False)
        results = {}
        for ratio in args.ratios:
            mask = mask_png(args.size, args.size, ratio)
            latency: dict[str, list[float]] = {mode: [] for mode in MODES}
            images: dict[str, list[np.ndarray]] = {mode: [] for mode in MODES}
            for i in range(args.sequential):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    seconds, picture = await edit(client, url, image, mask, seed=100 + i, cached=mode == "cached")
                    latency[mode].append(seconds)
                    images[mode].append(picture)
            throughput = {}
            for mode in MODES:
                started = time.perf_counter()
                await asyncio.gather(*(edit(client, url, image, mask, seed=200 + i, cached=mode == "cached")
                                       for i in range(args.burst)))
                throughput[mode] = args.burst / (time.perf_counter() - started)
            pairs = list(zip(images["cached"], images["recompute"]))
            results[str(ratio)] = {
                "latency_s": latency, "throughput_rps": throughput,
                "latency_speedup": statistics.median(latency["recompute"]) / statistics.median(latency["cached"]),
                "throughput_speedup": throughput["cached"] / throughput["recompute"],
                "psnr_db": [psnr(a, b) for a, b in pairs], "ssim": [ssim(a, b) for a, b in pairs],
            }
            r = results[str(ratio)]
            log(f"  mask {ratio}: latency {r['latency_speedup']:.2f}x, throughput {r['throughput_speedup']:.2f}x, "
                f"SSIM {statistics.mean(r['ssim']):.3f}, PSNR {statistics.mean(r['psnr_db']):.1f} dB")
        return results


def cache_stats(exposition: str) -> dict[str, float]:
    """The activation stores' counts (`stepserve_activation_cache_events_total`, by event) and
    contents (`stepserve_activation_cache`, by stat), summed over nodes."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "stepserve_activation_cache":
                key = sample.labels["stat"]
            elif sample.name == "stepserve_activation_cache_events_total":
                key = sample.labels["event"]
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    ratios = list(report["results"])
    x = np.arange(len(ratios))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode, shift in zip(MODES, (-0.2, 0.2)):
        axes[0].bar(x + shift, [statistics.median(report["results"][r]["latency_s"][mode]) for r in ratios], 0.4,
                    label=mode)
        axes[1].bar(x + shift, [report["results"][r]["throughput_rps"][mode] for r in ratios], 0.4, label=mode)
    axes[2].bar(x, [statistics.mean(report["results"][r]["ssim"]) for r in ratios], 0.5, color="tab:green")
    for ax, title in zip(axes, ("median latency (s), one at a time", "throughput (edits/s), burst",
                                "SSIM cached vs exact")):
        ax.set_xticks(x, [f"mask {r}" for r in ratios])
        ax.set_title(title, fontsize=10)
    for i, r in enumerate(ratios):
        axes[0].annotate(f"{report['results'][r]['latency_speedup']:.2f}x", (i, 0), ha="center", va="bottom")
        axes[1].annotate(f"{report['results'][r]['throughput_speedup']:.2f}x", (i, 0), ha="center", va="bottom")
    axes[0].legend()
    axes[2].set_ylim(0, 1)
    fig.suptitle(f"edits of one template, cached activations vs recompute ({report['model']}, "
                 f"{report['size']} px, {report['steps']} steps, {report['machine']['cpu_count']} CPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with local_ray(args.num_cpus):
        config = serve_config(args, free_port())
        with deployed(config) as url:
            asyncio.run(wait_ready(url))
            results = asyncio.run(measure(url, args))
            cache = cache_stats(asyncio.run(scrape_text(url)))
    report = {"benchmark": "edit_cache", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
              "model": f"sd3 preset {args.preset}", "size": args.size, "steps": args.steps,
              "sequential": args.sequential, "burst": args.burst, "worker_threads": args.threads,
              "activation_cache": cache, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edit_cache.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "edit_cache.png")
    print(f"activation store: {cache}")
    for ratio, r in results.items():
        print(f"mask {ratio}: cached vs recompute latency {r['latency_speedup']:.2f}x, throughput "
              f"{r['throughput_speedup']:.2f}x, SSIM {statistics.mean(r['ssim']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
