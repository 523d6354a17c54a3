"""Writing a training run as the folders the server loads: diffusers' own layouts, safetensors.

    <out>/sd/                         StableDiffusionPipeline folder (tokenizer, text_encoder, unet, vae, scheduler)
    <out>/controlnet-silhouette/      ControlNetModel folder
    <out>/lora-outlined/              pytorch_lora_weights.safetensors (diffusers' LoRA format)
    <out>/sd3/                        StableDiffusion3Pipeline folder (three tokenizers and text encoders,
                                      transformer, the same VAE, scheduler)
    <out>/judge/                      the judge (config.json + safetensors)
    <out>/training.json               seed, sizes, schedule, seconds and the first losses of each stage
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline

from stepserve.engine.addons.presets import save_lora_file
from stepserve.engine.families.sd15 import SD_SCHEDULER
from stepserve.engine.shapes.training import ShapesTraining

# Where the shipped weights live, and what configs name them by (relative to configs/).
SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "models" / "shapes"
LOGGED_LOSSES = 5  # the first losses of each stage kept in training.json (the reproducibility test's)


def train_all(out: str | os.PathLike, run: ShapesTraining, vae_from: str | os.PathLike | None = None) -> dict:
    """Train every stage of `run` and write its folders under `out`; returns training.json's content.

    `vae_from`: an earlier run's folder, with the same seed and VAE schedule, whose VAE (the first
    stage, deterministic) is taken instead of trained again; its log and time are carried over."""
    out = Path(out)
    seconds, carried = {}, {}

    def timed(name, stage, *args):
        start = time.perf_counter()
        result = stage(*args)
        seconds[name] = round(time.perf_counter() - start, 1)
        return result

    if vae_from is None:
        vae = timed("vae", run.train_vae)
    else:
        vae, carried = reuse_vae(Path(vae_from), run)
        seconds["vae"] = carried["seconds"]
    text, unet = timed("unet", run.train_text_unet)
    controlnet = timed("controlnet", run.train_controlnet)
    lora = timed("lora", run.train_lora)
    sd3 = timed("dit", run.train_dit, vae)
    judge = timed("judge", run.train_judge)

    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text, tokenizer=run.tokenizer, unet=unet,
        scheduler=EulerDiscreteScheduler(**SD_SCHEDULER, prediction_type=run.schedule.prediction_type),
        safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out / "sd", safe_serialization=True)
    controlnet.save_pretrained(out / "controlnet-silhouette", safe_serialization=True)
    save_lora_file(lora, str(out / "lora-outlined"))
    sd3.save_pretrained(out / "sd3", safe_serialization=True)
    judge.save_pretrained(out / "judge", safe_serialization=True)
    record = {
        "seed": run.seed,
        "sizes": dataclasses.asdict(run.sizes),
        "schedule": dataclasses.asdict(run.schedule),
        "seconds": seconds,
        "first_losses": {**carried.get("first_losses", {}),
                         **{stage: losses[:LOGGED_LOSSES] for stage, losses in run.logs.items()}},
        "last_losses": {**carried.get("last_losses", {}),
                        **{stage: sum(losses[-50:]) / len(losses[-50:]) for stage, losses in run.logs.items()}},
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def reuse_vae(folder: Path, run: ShapesTraining) -> tuple[AutoencoderKL, dict]:
    """The VAE of an earlier run of the same seed and VAE schedule, and that stage's record."""
    record = json.loads((folder / "training.json").read_text())
    vae_keys = [key for key in record["schedule"] if key.startswith("vae_")] + ["samples"]
    if record["seed"] != run.seed or any(record["schedule"][k] != getattr(run.schedule, k) for k in vae_keys) \
            or record["sizes"]["vae"] != json.loads(json.dumps(run.sizes.vae)):
        raise ValueError(f"{folder}: its VAE was trained with another seed, VAE schedule or VAE size")
    vae = AutoencoderKL.from_pretrained(str(folder / "sd"), subfolder="vae", use_safetensors=True)
    run.use_vae(vae)
    return vae, {"seconds": record["seconds"]["vae"], "first_losses": {"vae": record["first_losses"]["vae"]},
                 "last_losses": {"vae": record["last_losses"]["vae"]}}
