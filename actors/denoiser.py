"""The denoiser worker: one per GPU (or N on CPU), holding denoisers and running plans.

A plain class; `actors.pool` turns it into an addressable Ray actor. Latents never leave the
worker until a request finishes; conditioning arrives as Ray object refs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import ray
import torch

from ..engine.families import DENOISER, ModelSource, load_family
from ..engine.sampler import Conditioning
from ..engine.step_runner import StepRunner
from ..policies.types import RequestSpec, StepReport, WorkerPlan


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class DenoiserWorker:
    def __init__(self, worker_id: str, models: Sequence[ModelSource], device: str = "auto",
                 torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = resolve_device(device)
        families = {m.name: load_family(m, {DENOISER}, self.device) for m in models}
        self.runner = StepRunner(worker_id, families)

    def ready(self) -> str:
        return self.runner.worker_id

    def execute(
        self, plan: WorkerPlan, admissions: Mapping[str, tuple[RequestSpec, ray.ObjectRef]]
    ) -> tuple[StepReport, dict[str, np.ndarray]]:
        """Run one plan; `admissions` maps admitted ids to (spec, ref to (cond, uncond) arrays)."""
        resolved = {}
        if admissions:
            embeds = ray.get([ref for _, ref in admissions.values()])
            for (rid, (spec, _)), (cond, uncond) in zip(admissions.items(), embeds):
                resolved[rid] = (spec, Conditioning(
                    torch.from_numpy(cond), None if uncond is None else torch.from_numpy(uncond)
                ))
        report, finished = self.runner.execute(plan, resolved)
        return report, {rid: latents.float().cpu().numpy() for rid, latents in finished.items()}
