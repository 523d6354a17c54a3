"""The denoiser worker: one per GPU (or N on CPU), holding denoisers and running plans.

A plain class; `actors.pool` turns it into an addressable Ray actor. Latents never leave the
worker until a request finishes; conditioning arrives as Ray object refs.

Images run as plans (`execute`). Videos run one router call at a time (`video_*`), optionally
sequence-parallel with other workers of the same `SPWorld`, and can be paused to host memory and
resumed on another worker between steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from ..engine.families import DENOISER, VAE, ModelSource, load_family
from ..engine.sampler import Conditioning
from ..engine.step_runner import StepRunner
from ..engine.video_runner import VideoProgress, VideoRunner
from ..engine.video_sampler import VideoSpec
from ..policies.types import RequestSpec, StepReport, WorkerPlan
from .sp_world import DEFAULT_TIMEOUT_S, SPWorld, backend_for, rendezvous_address

# Families whose models generate videos. A finished video decodes on the worker that holds it
# (its latents are already there and decode is one call), so these also load their VAE here;
# images decode in the VAE deployment.
VIDEO_FAMILIES = frozenset({"wan"})

Embeddings = tuple[np.ndarray, np.ndarray | None]  # (prompt [1, seq, dim], negative or None)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def worker_parts(source: ModelSource) -> set[str]:
    return {DENOISER, VAE} if source.family in VIDEO_FAMILIES else {DENOISER}


class DenoiserWorker:
    def __init__(self, worker_id: str, models: Sequence[ModelSource], device: str = "auto",
                 torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = resolve_device(device)
        families = {m.name: load_family(m, worker_parts(m), self.device) for m in models}
        videos = {m.name for m in models if m.family in VIDEO_FAMILIES}
        self.runner = StepRunner(worker_id, {n: f for n, f in families.items() if n not in videos})
        self.videos = VideoRunner(worker_id, {n: f for n, f in families.items() if n in videos})
        self.sp_world: SPWorld | None = None

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

    def image_export(self, request_id: str) -> dict[str, Any]:
        """A resident image's state in host memory; it leaves this worker. Hand the ObjectRef
        straight to another worker's `image_import`."""
        return self.runner.export(request_id)

    def image_import(self, state: dict[str, Any]) -> None:
        self.runner.import_state(state)

    # ---- sequence-parallel world --------------------------------------------------------

    def sp_rendezvous_address(self) -> tuple[str, int]:
        """An address for `join_sp_world`, on this worker's node: ask the worker that will be rank 0."""
        return rendezvous_address()

    def join_sp_world(self, addr: str, port: int, rank: int, world_size: int,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Blocks until all ranks have joined: call it on every worker concurrently."""
        if self.sp_world is not None:
            raise RuntimeError(f"worker {self.ready()} already joined an SP world as rank {self.sp_world.rank}")
        self.sp_world = SPWorld.join(addr, port, rank, world_size, backend_for(self.device), timeout_s)

    def leave_sp_world(self) -> None:
        if self.sp_world is not None:
            self.sp_world.close()
            self.sp_world = None

    # ---- videos -------------------------------------------------------------------------

    def video_start(self, spec: VideoSpec, embeds: Embeddings) -> VideoProgress:
        """A new video. Pass the text encoder's ObjectRef itself as `embeds`: Ray resolves a
        top-level ref on the worker, so the arrays go from the object store to the worker
        without the router fetching them. For a video starting at SP degree d, start it on each
        of the d workers (the same seed gives them the same state)."""
        cond, uncond = embeds
        # Copies: the arrays Ray hands over are read-only views of the object store, and a video
        # keeps its context for its whole life (and exports it).
        conditioning = Conditioning(torch.from_numpy(np.array(cond)),
                                    None if uncond is None else torch.from_numpy(np.array(uncond)))
        return self.videos.start(spec, conditioning)

    def video_step(self, job_id: str, ranks: tuple[int, ...]) -> VideoProgress:
        """One step of `job_id` over the SP group `ranks` (world ranks; a 1-tuple means this
        worker alone, and needs no world). Every worker in `ranks` must get this call for the
        same video at the same step."""
        return self.videos.step(job_id, self._sp_group(tuple(ranks)))

    def video_export(self, job_id: str) -> dict[str, Any]:
        """Pause: the video's state in host memory; it leaves this worker (other SP members call
        `video_drop`). Hand the returned ObjectRef straight to another worker's `video_import`.
        `state["paused"]` is a `VideoProgress` with the export's seconds."""
        return self.videos.export(job_id)

    def video_import(self, state: dict[str, Any]) -> VideoProgress:
        """Resume an exported video here, to be stepped at any SP degree; import it on every
        member of the group it will run on. `duration_s` is the import's seconds."""
        return self.videos.import_state(state)

    def video_drop(self, job_id: str) -> None:
        self.videos.drop(job_id)

    def video_decode(self, job_id: str) -> np.ndarray:
        """A finished video's frames, uint8 [F, H, W, 3]; the video leaves this worker (other SP
        members call `video_drop`)."""
        return self.videos.decode(job_id)

    def _sp_group(self, ranks: tuple[int, ...]) -> Any | None:
        if self.sp_world is None:
            if len(ranks) != 1:
                raise RuntimeError(f"worker {self.ready()} has not joined an SP world; cannot run over ranks {ranks}")
            return None
        return self.sp_world.group(ranks)
