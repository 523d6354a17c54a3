"""One rank of a gloo group running CFG-split requests (latent parallelism), for
tests/cpu/engine/test_latent_parallel.py: a module of its own so a forkserver can import it."""

import dataclasses
from pathlib import Path

import torch

from stepserve.engine.addons.controlnet import control_pixels, control_tensor
from stepserve.engine.addons.lora import load_lora_file
from stepserve.engine.addons.presets import preset_controlnet
from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import ControlNetUse, GroupSplit, LoraUse, StepGroup, WorkerPlan

from tests.addons import CONTROLNETS
from tests.tiny import TINY, TINY_SDXL, conditioning_for, control_image, make_spec
from tests.tiny_video import gloo_group

IMAGES = {name: control_image(seed) for name, seed in CONTROLNETS.items()}
SOURCES = (TINY, TINY_SDXL)
STEPS = 4
DISSOLVE_AFTER = 2  # the "dissolved" case runs split this many steps, then on rank 0 alone


def spec_for(source, rid: str, seed: int):
    return dataclasses.replace(make_spec(rid, steps=STEPS, seed=seed, model=source.name, negative="blurry"),
                               controlnets=(ControlNetUse("canny", 0.8), ControlNetUse("depth", 0.6, end=0.5)),
                               loras=(LoraUse("papercut", 0.9),))


def served_family(source, lora_folders: dict[str, str]):
    family = load_family(source, ALL_PARTS, "cpu")
    for name, seed in CONTROLNETS.items():
        family.add_controlnet(name, preset_controlnet(source.family, source.preset, seed))
    for name, folder in lora_folders.items():
        family.add_lora(load_lora_file(name, folder))
    return family


def _admission(family, spec) -> Admission:
    text = conditioning_for(family, spec)
    control = tuple(control_tensor(control_pixels(IMAGES[use.name], spec.height, spec.width))
                    for use in spec.controlnets)
    return Admission(spec, conditioning=Conditioning(text.prompt, text.negative, control))


def _run(runner: StepRunner, family, spec, rank: int, process_group, split_steps: int):
    """The request's steps, the first `split_steps` split over ranks 0 and 1; then rank 0 goes on
    alone and rank 1 releases it. Returns the finished latents (None on a rank that released)."""
    rid = spec.request_id
    admissions = {rid: _admission(family, spec)}
    for step in range(STEPS):
        last = step == STEPS - 1
        if step < split_steps:
            group = StepGroup((rid,), (0, 1), GroupSplit.CFG)
        elif rank == 1:
            report, _ = runner.execute(WorkerPlan(f"w{rank}", release=(rid,), plan_id=step), {})
            assert not report.failed and rid not in runner.resident
            return None
        else:
            group = StepGroup((rid,))
        plan = WorkerPlan(f"w{rank}", admit=(rid,) if step == 0 else (), groups=(group,),
                          finish=(rid,) if last else (), plan_id=step)
        report, payloads = runner.execute(plan, admissions if step == 0 else {}, lambda ranks: process_group)
        assert not report.failed, report.failed
    return torch.from_numpy(payloads[0])


def cfg_split_worker(rank: int, world_size: int, port: int, out_dir: str, lora_folders: dict) -> None:
    with gloo_group(rank, world_size, port) as group:
        out = {}
        for i, source in enumerate(SOURCES):
            family = served_family(source, lora_folders[source.name])
            runner = StepRunner(f"w{rank}", {source.name: family})
            out[f"{source.name}/split"] = _run(runner, family, spec_for(source, "split", 20 + i), rank, group, STEPS)
            out[f"{source.name}/dissolved"] = _run(runner, family, spec_for(source, "dissolved", 30 + i), rank, group,
                                                   DISSOLVE_AFTER)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
