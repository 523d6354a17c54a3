"""Executes one `WorkerPlan`: drop, admit, then one denoiser forward per shape group.

The runner owns the samplers of the requests resident on its device. It never decides what
runs; policies do. Finished latents are handed back and forgotten here, so decoding happens
elsewhere and never stalls the step loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from ..policies.types import RequestProgress, RequestSpec, StepReport, WorkerPlan
from .families.base import DiffusionFamily
from .sampler import Conditioning, RequestSampler


class StepRunner:
    def __init__(self, worker_id: str, families: Mapping[str, DiffusionFamily]):
        self.worker_id = worker_id
        self.families = dict(families)
        self.samplers: dict[str, RequestSampler] = {}

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(self.samplers)

    def admit(self, spec: RequestSpec, conditioning: Conditioning) -> RequestSampler:
        if spec.request_id in self.samplers:
            raise ValueError(f"request {spec.request_id} is already resident")
        if spec.model not in self.families:
            raise ValueError(f"model {spec.model!r} is not loaded on worker {self.worker_id}")
        sampler = RequestSampler(spec, self.families[spec.model], conditioning)
        self.samplers[spec.request_id] = sampler
        return sampler

    def drop(self, request_id: str) -> None:
        self.samplers.pop(request_id, None)

    def export(self, request_id: str) -> dict:
        """A resident request's state in host memory; it leaves this worker (the co-serving
        router moves it to the worker its batch runs on next)."""
        sampler = self.samplers.pop(request_id, None)
        if sampler is None:
            raise KeyError(f"request {request_id!r} is not resident on worker {self.worker_id}")
        return sampler.state()

    def import_state(self, state: dict) -> None:
        """Make an exported request resident here; its next step continues where it stopped."""
        spec = state["spec"]
        if spec.request_id in self.samplers:
            raise ValueError(f"request {spec.request_id} is already resident")
        if spec.model not in self.families:
            raise ValueError(f"model {spec.model!r} is not loaded on worker {self.worker_id}")
        self.samplers[spec.request_id] = RequestSampler.from_state(state, self.families[spec.model])

    def step_group(self, request_ids: tuple[str, ...]) -> None:
        """One forward for requests of one shape key; each advances one step."""
        samplers = [self.samplers[rid] for rid in request_ids]
        family = self.families[samplers[0].spec.model]
        inputs = [s.model_input() for s in samplers]
        if len(inputs) == 1:
            sample, timesteps, context = inputs[0]
        else:
            sample, timesteps, context = (torch.cat(parts) for parts in zip(*inputs))
        noise_pred = family.denoise(sample, timesteps, context)
        for sampler, rows in zip(samplers, noise_pred.split([s.rows for s in samplers])):
            sampler.advance(rows)

    @torch.inference_mode()
    def execute(
        self, plan: WorkerPlan, admissions: Mapping[str, tuple[RequestSpec, Conditioning]]
    ) -> tuple[StepReport, dict[str, torch.Tensor]]:
        """Run a plan. A failing admission or group fails only its own requests."""
        start = time.perf_counter()
        failed: dict[str, str] = {}
        touched: list[str] = []
        for rid in plan.drop:
            self.drop(rid)
        for rid in plan.admit:
            try:
                spec, conditioning = admissions[rid]
                self.admit(spec, conditioning)
                touched.append(rid)
            except Exception as exc:  # bad request state must not take the worker down
                failed[rid] = f"admission failed: {exc}"
        for group in plan.groups:
            group = tuple(rid for rid in group if rid in self.samplers)
            if not group:
                continue
            try:
                self.step_group(group)
            except Exception as exc:
                for rid in group:
                    failed[rid] = f"denoising step failed: {type(exc).__name__}: {exc}"
                    self.drop(rid)
                continue
            touched.extend(group)
        finished: dict[str, torch.Tensor] = {}
        progress = []
        for rid in dict.fromkeys(touched):
            sampler = self.samplers.get(rid)
            if sampler is None:
                continue
            progress.append(RequestProgress(rid, sampler.step_index, sampler.steps_total))
            if sampler.done:
                finished[rid] = self.samplers.pop(rid).latents
        report = StepReport(
            worker_id=self.worker_id,
            progress=tuple(progress),
            finished=tuple(finished),
            failed=tuple(failed.items()),
            duration_s=time.perf_counter() - start,
            batch_size=len(plan.stepping),
        )
        return report, finished
