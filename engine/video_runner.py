"""The videos resident on one worker: start, step (alone or sequence-parallel), pause to host
memory, resume, decode.

The video counterpart of `StepRunner`. It never decides what runs; the router does, one step
at a time. Each step is one forward for one video, optionally split over a process group
(`sp_group`) whose members all call `step` for the same video at the same step. Ulysses hands
every member the full output, so all members hold identical full state: any one of them can
export the video while the others drop their copies, and the exported state resumes on any
worker at any SP degree (see `engine.video_sampler`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .families.base import DiffusionFamily
from .sampler import Conditioning
from .video_sampler import VideoSampler, VideoSpec

# The key under which `VideoRunner.export` adds its own `VideoProgress` (with the export's
# seconds) to the sampler state. `VideoSampler.from_state` ignores it.
PAUSED = "paused"


@dataclass(frozen=True)
class VideoProgress:
    """Where one video stands after a runner call, and the seconds that call took on the worker
    (the step; the export to host memory; the import from it; the setup of a new video)."""

    job_id: str
    steps_done: int
    steps_total: int
    duration_s: float

    @property
    def done(self) -> bool:
        return self.steps_done >= self.steps_total


class VideoRunner:
    def __init__(self, worker_id: str, families: Mapping[str, DiffusionFamily]):
        self.worker_id = worker_id
        self.families = dict(families)
        self.samplers: dict[str, VideoSampler] = {}

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(self.samplers)

    def start(self, spec: VideoSpec, conditioning: Conditioning) -> VideoProgress:
        """A new video at step 0 (deterministic by seed, so every SP member may start its own copy)."""
        begin = time.perf_counter()
        family = self._family_for(spec)
        sampler = VideoSampler(spec, family, conditioning)
        self.samplers[spec.request_id] = sampler
        return self._progress(sampler, begin)

    def step(self, job_id: str, sp_group: Any = None) -> VideoProgress:
        """One denoising step. With `sp_group` every member must make this call for the same video
        at the same step; a failing step leaves the video where it was (the scheduler advances
        only after the forward)."""
        sampler = self._sampler(job_id)
        begin = time.perf_counter()
        sampler.step(self.families[sampler.spec.model], sp_group)
        return self._progress(sampler, begin)

    def export(self, job_id: str) -> dict[str, Any]:
        """Pause: the video's whole state as host-memory copies (picklable), and the video leaves
        this worker. The state also carries `state[PAUSED]`, a `VideoProgress` whose `duration_s`
        is the device-to-host copy time."""
        sampler = self._sampler(job_id)
        begin = time.perf_counter()
        state = sampler.state("cpu")  # `.to("cpu")` waits for the device, so the time is honest
        del self.samplers[job_id]
        state[PAUSED] = VideoProgress(job_id, sampler.step_index, sampler.steps_total, time.perf_counter() - begin)
        return state

    def import_state(self, state: dict[str, Any]) -> VideoProgress:
        """Resume a video exported anywhere (at any SP degree) on this worker."""
        begin = time.perf_counter()
        family = self._family_for(state["spec"])
        sampler = VideoSampler.from_state(state, family)
        self.samplers[sampler.spec.request_id] = sampler
        return self._progress(sampler, begin)

    def drop(self, job_id: str) -> None:
        """Forget a video (cancelled, or another SP member exported it). Unknown ids are ignored,
        so a drop is safe to repeat."""
        self.samplers.pop(job_id, None)

    def decode(self, job_id: str) -> np.ndarray:
        """A finished video's frames, uint8 [F, H, W, 3], decoded by this worker's VAE alone; the
        video leaves this worker once decoded."""
        sampler = self._sampler(job_id)
        if not sampler.done:
            raise ValueError(
                f"video {job_id} has {sampler.steps_total - sampler.step_index} steps left; only finished videos decode"
            )
        family = self.families[sampler.spec.model]
        if getattr(family, "vae", None) is None:
            raise ValueError(f"model {sampler.spec.model!r} has no VAE loaded on worker {self.worker_id}")
        video = family.decode(sampler.latents)[0]
        del self.samplers[job_id]
        # Rounded as diffusers' `numpy_to_pil` rounds (the frames are already clamped to [0, 1]).
        return (video * 255).round().astype(np.uint8)

    # ---- internals ----------------------------------------------------------------------

    def _family_for(self, spec: Any) -> DiffusionFamily:
        if spec.request_id in self.samplers:
            raise ValueError(f"video {spec.request_id} is already resident on worker {self.worker_id}")
        if spec.model not in self.families:
            raise ValueError(f"model {spec.model!r} is not loaded on worker {self.worker_id}")
        return self.families[spec.model]

    def _sampler(self, job_id: str) -> VideoSampler:
        sampler = self.samplers.get(job_id)
        if sampler is None:
            raise KeyError(f"video {job_id} is not resident on worker {self.worker_id}")
        return sampler

    def _progress(self, sampler: VideoSampler, begin: float) -> VideoProgress:
        if sampler.device.type == "cuda":  # kernels are asynchronous; count them in the call's time
            torch.cuda.synchronize(sampler.device)
        return VideoProgress(sampler.spec.request_id, sampler.step_index, sampler.steps_total,
                             time.perf_counter() - begin)
