"""What the shipped shapes models draw, judged: the exact path's prompt accuracy on held-out
prompts (the share whose shape and colour the judge finds as asked), the silhouette ControlNet's
agreement with its control image, the outlined LoRA's effect, and a grid of pictures for the README.

Every picture is made by the worker's engine (`StepRunner`, one batched forward per step, the
worker's own decode), with the model and add-ons of the config, as the server makes it.

    python -m stepserve.load_tests.bench_shapes --out docs/results/shapes

Writes shapes.json, shapes.png (accuracy bars) and grid.png.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

from stepserve.engine.sampler import RequestInputs
from stepserve.engine.shapes import dataset
from stepserve.engine.shapes.judge import Judge, pixels, prompt_accuracy
from stepserve.engine.shapes.export import SHIPPED
from stepserve.policies.types import ControlNetUse, GroupSplit, LoraUse, RequestSpec, StepGroup, WorkerPlan
from stepserve.runtime import default_config_path, load_serve_config

HELD_OUT_SEED = 2026  # the dataset seed of the held-out prompts (training used seed 0)
GRID = [f"{'an' if c[0] in 'aeiou' else 'a'} {c} {s} on a {b} background"
        for c, b in (("red", "white"), ("blue", "yellow"), ("green", "black"), ("orange", "blue"))
        for s in dataset.SHAPES]


def draw(family, specs: Sequence[RequestSpec], inputs: Sequence[RequestInputs] = (), runner=None,
         split_over: Any = None) -> np.ndarray:
    """The specs' pictures (uint8 [n, h, w, 3]), denoised together, one forward per step, by
    `runner` (default: a plain worker's `StepRunner`). `inputs`: each spec's control images or
    edit (default: none). `split_over`: a two-rank process group each request's CFG rows are split
    over (one group, one forward, per request)."""
    from stepserve.engine.sampler import Conditioning
    from stepserve.engine.step_runner import Admission, StepRunner
    from stepserve.engine.text_encoding import encode_pair

    runner = runner or StepRunner("bench", {specs[0].model: family}, decode_images=True)
    inputs = list(inputs) or [RequestInputs()] * len(specs)
    admissions = {spec.request_id: Admission(spec, conditioning=Conditioning.from_numpy(*encode_pair(family, spec), i))
                  for spec, i in zip(specs, inputs)}
    ids = tuple(admissions)
    groups = (tuple(StepGroup((rid,), (0, 1), GroupSplit.CFG) for rid in ids) if split_over is not None
              else (StepGroup(ids),))
    report, _ = runner.execute(WorkerPlan(runner.worker_id, admit=ids, plan_id=0), admissions)
    total = report.progress[0].steps_total
    for step in range(1, total + 1):
        plan = WorkerPlan(runner.worker_id, groups=groups, plan_id=step, finish=ids if step == total else ())
        report, payloads = runner.execute(plan, {}, sp_group=lambda ranks: split_over)
        if report.failed:
            raise RuntimeError(report.failed[0].message)
    return np.stack([np.asarray(PIL.Image.open(io.BytesIO(png)).convert("RGB")) for png in payloads])


def specs_for(prompts: Sequence[str], args: argparse.Namespace, tag: str, **extra) -> list[RequestSpec]:
    return [RequestSpec(request_id=f"{tag}-{i}", model=args.model, prompt=prompt, width=args.size, height=args.size,
                        num_inference_steps=args.steps, guidance_scale=args.guidance, seed=args.seed + i, **extra)
            for i, prompt in enumerate(prompts)]


def in_batches(family, specs, inputs: Sequence[RequestInputs] = (), batch: int = 25, runner=None) -> np.ndarray:
    """`draw` of the specs, `batch` at a time, on `runner` (default: a plain worker's)."""
    inputs = list(inputs)
    return np.concatenate([draw(family, specs[i:i + batch], inputs[i:i + batch], runner=runner)
                           for i in range(0, len(specs), batch)])


def controlled(images: np.ndarray) -> list[RequestInputs]:
    """Each control image (uint8 [h, w, 3]) as the inputs of a request with one ControlNet."""
    return [RequestInputs(control=(image,)) for image in images]


def reconstructions(family, pictures: np.ndarray) -> np.ndarray:
    """`pictures` through the model's VAE and back (posterior means): the judge's score on these
    is the most any picture the model draws can get."""
    mean, _ = family.encode_image(pixels(pictures))
    return (family.decode(family.image_latents(mean)) * 255).round().astype(np.uint8)


def shape_mask(pictures: np.ndarray, scenes: Sequence[dataset.Scene]) -> np.ndarray:
    """Where each picture is not its scene's background colour (what was drawn)."""
    background = np.array([dataset.COLOURS[s.background] for s in scenes])[:, None, None, :]
    return np.abs(pictures.astype(int) - background).max(-1) > 60


def iou(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([(x & y).sum() / max(1, (x | y).sum()) for x, y in zip(a, b)]))


def add_drawing_arguments(parser: argparse.ArgumentParser, prompts: int) -> None:
    """What a benchmark that draws held-out prompts with a served model is asked: the config and
    model, how many prompts, and the requests' steps, guidance, size and first seed."""
    parser.add_argument("--config", type=Path, default=default_config_path(),
                        help="Serve config (default: %(default)s)")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--prompts", type=int, default=prompts, help="held-out prompts (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's default_guidance_scale")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)


def load_served(args: argparse.Namespace):
    """The config's app, `args.model`'s config and its family loaded as a worker loads it, with
    the config's ControlNets and LoRAs of that model, and the judge; `args.guidance` defaults to
    the model's. Call inside `quiet_libraries`."""
    from stepserve.engine.addons.source import AddonKind, load_addon
    from stepserve.oneshot import app_config, load_model

    app = app_config(load_serve_config(args.config))
    model = app.model(args.model)
    args.guidance = model.default_guidance_scale if args.guidance is None else args.guidance
    family = load_model(model, "cpu")
    for kind, addons in ((AddonKind.CONTROLNET, app.controlnets), (AddonKind.LORA, app.loras)):
        for addon in addons:
            if addon.model == args.model:
                load_addon(addon.to_source(kind), family)
    return app, model, family, Judge.from_pretrained(str(SHIPPED / "judge"), use_safetensors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_shapes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_drawing_arguments(parser, prompts=200)
    parser.add_argument("--addon-prompts", type=int, default=50,
                        help="held-out prompts per add-on (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/shapes"))
    args = parser.parse_args(argv)

    import torch

    from stepserve.load_tests.plots import plot_shapes
    from stepserve.oneshot import quiet_libraries

    torch.set_num_threads(args.threads)
    with quiet_libraries():
        _, _, family, judge = load_served(args)
        held_out = dataset.Renders(HELD_OUT_SEED, args.prompts)
        prompts = [s.caption for s in held_out.scenes]
        start = time.perf_counter()
        exact = in_batches(family, specs_for(prompts, args, "exact"))
        seconds = time.perf_counter() - start
        named = judge.name(exact)
        rows = {"exact": {
            "prompt_accuracy": prompt_accuracy(judge, exact, held_out.scenes),
            "shape_accuracy": float(np.mean([n[0] == s.shape for n, s in zip(named, held_out.scenes)])),
            "colour_accuracy": float(np.mean([n[1] == s.colour for n, s in zip(named, held_out.scenes)])),
            "renders_judged": prompt_accuracy(judge, held_out.pictures(np.arange(args.prompts)), held_out.scenes),
            "reconstructions_judged": prompt_accuracy(
                judge, reconstructions(family, held_out.pictures(np.arange(args.prompts))), held_out.scenes),
        }}
        k = min(args.addon_prompts, args.prompts)
        scenes, silhouettes = held_out.scenes[:k], held_out.silhouettes(np.arange(k))
        if family.controlnets:
            name = next(iter(family.controlnets))
            guided = in_batches(family, specs_for(prompts[:k], args, "cn", controlnets=(ControlNetUse(name),)),
                                controlled(silhouettes))
            inside = silhouettes[..., 0] > 127
            rows[f"controlnet {name}"] = {
                "prompt_accuracy": prompt_accuracy(judge, guided, scenes),
                "silhouette_iou": iou(shape_mask(guided, scenes), inside),
                "silhouette_iou_without": iou(shape_mask(exact[:k], scenes), inside),
            }
        if family.loras:
            name = next(iter(family.loras))
            styled = in_batches(family, specs_for(prompts[:k], args, "lora", loras=(LoraUse(name),)))
            # Outlined shapes cover less of the picture than filled ones.
            rows[f"lora {name}"] = {
                "prompt_accuracy": prompt_accuracy(judge, styled, scenes),
                "drawn_fraction": float(shape_mask(styled, scenes).mean()),
                "drawn_fraction_without": float(shape_mask(exact[:k], scenes).mean()),
            }
        grid = in_batches(family, specs_for(GRID, args, "grid"))
    args.out.mkdir(parents=True, exist_ok=True)
    side = args.size
    sheet = grid.reshape(4, 4, side, side, 3).transpose(0, 2, 1, 3, 4).reshape(4 * side, 4 * side, 3)
    PIL.Image.fromarray(sheet).resize((4 * 128, 4 * 128), PIL.Image.Resampling.NEAREST).save(args.out / "grid.png")
    report = {"benchmark": "shapes", "setup": {**vars(args), "config": str(args.config), "out": str(args.out)},
              "seconds_exact": round(seconds, 1), "grid_prompts": GRID, "rows": rows}
    (args.out / "shapes.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_shapes(rows, f"shapes models: {args.prompts} held-out prompts, {args.steps} steps, CFG {args.guidance}",
                args.out / "shapes.png")
    for name, row in rows.items():
        print(name, {k: round(v, 3) for k, v in row.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
