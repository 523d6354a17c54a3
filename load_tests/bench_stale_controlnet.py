"""The fidelity of one-step-stale ControlNets (`controlnet_service.stale`, SwiftDiffusion §4.1's
pipelined ControlNet, Table 5): each request is denoised with the service's residuals of the
same step (exact, equal to the diffusers ControlNet pipeline) and of the previous step, and the
stale image is compared with the exact one (PSNR, SSIM). For scale, the image without its
ControlNets is compared too: stale must be far closer to exact than that.

The service is its replica class in this process (`InProcessControlNets`), on a thread, as the
golden tests run it; the transport plays no part in what is computed.

    python -m stepserve.load_tests.bench_stale_controlnet --out docs/results/stale-controlnet
    python -m stepserve.load_tests.bench_stale_controlnet --family sdxl --preset full --device cuda ...

Writes stale_controlnet.json and stale_controlnet.png.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from stepserve.actors.controlnet_client import InProcessControlNets
from stepserve.deployments.controlnet_service import ControlNetService
from stepserve.engine.addons.controlnet import control_pixels, control_tensor
from stepserve.engine.addons.source import AddonKind, AddonSource
from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.sampler import Conditioning
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.load_tests.addon_mix import control_image_b64
from stepserve.load_tests.fidelity import psnr, ssim
from stepserve.load_tests.plots import plot_stale_controlnet
from stepserve.policies.types import ControlNetUse, RequestSpec, StepGroup, WorkerPlan

NAMES = ("canny", "depth", "pose")


def image(family, spec: RequestSpec, stale: bool) -> np.ndarray:
    """The request's image, denoised alone by a worker's step runner, its ControlNets stale or exact."""
    text = encode_conditioning(family, spec)
    control = tuple(control_tensor(control_pixels(_png(use.name, spec), spec.height, spec.width))
                    for use in spec.controlnets)
    runner = StepRunner("bench", {spec.model: family}, modes=ModeSettings(stale_controlnets=stale))
    admission = Admission(spec, Conditioning(text.prompt, text.negative, control))
    step, rid = (StepGroup((spec.request_id,)),), spec.request_id
    plan = WorkerPlan("bench", admit=(rid,), groups=step, steps=spec.steps_to_run, finish=(rid,))
    report, (latents,) = runner.execute(plan, {rid: admission})
    if report.failed:
        raise RuntimeError(report.failed[0].message)
    return family.decode(torch.from_numpy(latents))[0]


def _png(name: str, spec: RequestSpec) -> PIL.Image.Image:
    return PIL.Image.open(io.BytesIO(base64.b64decode(control_image_b64(name, spec.width, spec.height))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_stale_controlnet",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="sd15", choices=["sd15", "sdxl"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    source = ModelSource(name="bench", family=args.family, preset=args.preset)
    family = load_family(source, ALL_PARTS, args.device)
    sources = [AddonSource(AddonKind.CONTROLNET, name, source.name, preset=args.preset, seed=i + 1)
               for i, name in enumerate(NAMES)]
    family.controlnet_service = InProcessControlNets(ControlNetService(sources, [source], args.device))
    rows = []
    for steps in args.steps:
        for count in (1, 3):
            for seed in args.seeds:
                spec = RequestSpec(request_id=f"s{seed}", model=source.name, prompt="a tower by the sea",
                                   width=args.size, height=args.size, num_inference_steps=steps, guidance_scale=7.5,
                                   seed=seed, controlnets=tuple(ControlNetUse(n) for n in NAMES[:count]))
                exact, stale = image(family, spec, False), image(family, spec, True)
                without = image(family, dataclasses.replace(spec, controlnets=()), False)
                rows.append({"steps": steps, "controlnets": count, "seed": seed,
                             "stale_psnr_db": psnr(stale, exact), "stale_ssim": ssim(stale, exact),
                             "no_controlnet_psnr_db": psnr(without, exact), "no_controlnet_ssim": ssim(without, exact)})
    summary = [{"steps": steps, "controlnets": count,
                **{key: statistics.median(r[key] for r in rows if r["steps"] == steps and r["controlnets"] == count)
                   for key in ("stale_psnr_db", "stale_ssim", "no_controlnet_psnr_db", "no_controlnet_ssim")}}
               for steps in args.steps for count in (1, 3)]
    report = {"benchmark": "stale_controlnet", "setup": {**vars(args), "out": str(args.out),
                                                           "torch": torch.__version__},
              "summary": summary, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stale_controlnet.json").write_text(json.dumps(report, indent=1))
    plot_stale_controlnet(summary, f"one-step-stale ControlNets vs exact: {args.family} {args.preset}",
                          args.out / "stale_controlnet.png")
    for s in summary:
        print(f"{s['steps']} steps, {s['controlnets']} ControlNet(s): stale {s['stale_psnr_db']:.1f} dB / SSIM "
              f"{s['stale_ssim']:.3f}; without ControlNets {s['no_controlnet_psnr_db']:.1f} dB / "
              f"{s['no_controlnet_ssim']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
