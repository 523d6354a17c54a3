"""A small analytic stand-in for the profiled cost model, and builders for hand-made rounds."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.genserve import (
    GenServeConfig,
    ImageRequest,
    RoundInput,
    VideoJob,
    VideoStatus,
)
from stepserve.policies.types import ShapeKey

SMALL = ShapeKey("sd", 512, 512)
LARGE = ShapeKey("sd", 1024, 1024)
VIDEO_UNIT = 480 * 832 * 81  # one 480p, 81-frame clip


@dataclass
class FakeCosts:
    """A `StepCosts` of two formulas, told apart by frames as ObservedOverheadCosts does.

    Image step (one frame): a fixed per-forward cost plus a per-row cost, so batching pays off
    (Fig. 3); an edit of a cached template pays the per-row cost on its masked share only
    (InstGenIE's `MaskAwareCosts`). Video step: the work split over the SP degree plus a communication cost per extra
    worker, so SP scales sublinearly (Figs. 5-6); it ignores rows, as every test video has CFG.
    `video_steps[model][degree]` overrides the video formula (a missing degree means the model
    cannot run at it)."""

    image_fixed: float = 0.02
    image_per_row_mpx: float = 0.04
    video_unit_s: float = 4.0
    comm_s: float = 0.05
    video_steps: dict[str, dict[int, float]] = field(default_factory=dict)
    # Add-ons: seconds per row of each ControlNet call, and per LoRA row (0: add-ons are free).
    controlnet_row_s: float = 0.0
    lora_row_s: float = 0.0
    calls: int = 0

    def step_seconds(self, batch: BatchShape) -> float:
        self.calls += 1
        if batch.frames == 1:
            return self.image_fixed + self.image_per_row_mpx * batch.rows * batch.height * batch.width / 1e6 \
                * batch.mask_ratio + self.controlnet_row_s * sum(batch.controlnet_rows) \
                + self.lora_row_s * batch.lora_rows
        if batch.model in self.video_steps:
            return self.video_steps[batch.model].get(batch.sp_degree, math.inf)
        work = self.video_unit_s * batch.pixels / VIDEO_UNIT
        return work / batch.sp_degree + self.comm_s * (batch.sp_degree - 1)


def workers(n: int) -> tuple[str, ...]:
    return tuple(f"w{i}" for i in range(n))


def img(rid: str, deadline: float, steps: int = 20, key: ShapeKey = SMALL, rows: int = 2,
        arrival: float = 0.0, worker: str | None = None, share: float = 1.0, controlnets: tuple[str, ...] = (),
        loras: int = 0) -> ImageRequest:
    return ImageRequest(rid, key, rows, steps, deadline, arrival, worker, share, controlnets, loras)


def vid(jid: str, deadline: float, steps: int = 40, on: tuple[str, ...] = (), paused: bool = False,
        model: str = "wan", size: tuple[int, int] = (480, 832), frames: int = 81, arrival: float = 0.0,
        rows: int = 2) -> VideoJob:
    status = VideoStatus.RUNNING if on else (VideoStatus.PAUSED if paused else VideoStatus.QUEUED)
    return VideoJob(jid, model, size[0], size[1], frames, steps, deadline, arrival, status, tuple(on), rows)


def random_round(rng: random.Random, n_workers: int, n_videos: int, n_images: int,
                 config: GenServeConfig, now: float = 10.0) -> RoundInput:
    """Running videos on disjoint groups at permitted degrees, others queued or paused; images
    of two shape keys, some resident; deadlines from already missed to relaxed."""
    ws = list(workers(n_workers))
    free = list(ws)
    videos = []
    for j in range(n_videos):
        size = rng.choice([(240, 416), (480, 832), (720, 1280)])
        frames = rng.choice([17, 33, 81])
        steps = rng.randint(1, 50)
        deadline = now + rng.uniform(-5.0, 3.0) + steps * rng.uniform(0.05, 3.0)
        degrees = [d for d in config.sp_degrees if d <= len(free)]
        if not config.elastic_sp:
            degrees = [d for d in degrees if d == config.fixed_sp_degree]
        on: tuple[str, ...] = ()
        if degrees and rng.random() < 0.5:
            d = rng.choice(degrees)
            picked = rng.sample(free, d)
            free = [w for w in free if w not in picked]
            on = tuple(picked)
        videos.append(vid(f"v{j}", deadline, steps, on=on, paused=rng.random() < 0.5, size=size, frames=frames,
                          arrival=rng.uniform(0.0, now)))
    images = []
    for i in range(n_images):
        steps = rng.randint(1, 30)
        key = rng.choice([SMALL, LARGE])
        deadline = now + rng.uniform(-1.0, 2.0) + steps * rng.uniform(0.02, 0.3)
        worker = rng.choice([None, None] + ws)
        images.append(img(f"i{i}", deadline, steps, key=key, rows=rng.choice([1, 2]),
                          arrival=rng.uniform(0.0, now), worker=worker,
                          share=rng.choice([1.0, 1.0, round(rng.uniform(0.05, 1.0), 3)])))  # some edits
    return RoundInput(now, tuple(ws), tuple(images), tuple(videos))


def with_addons(rng: random.Random, inp: RoundInput) -> RoundInput:
    """The round with add-ons on about half its images (none on an edit of a cached template,
    as the workload draws them): a ControlNet or two of three, zero to two LoRAs."""
    images = []
    for image in inp.images:
        if image.computed_share == 1.0 and rng.random() < 0.5:
            image = replace(image, controlnets=tuple(rng.sample(("canny", "depth", "pose"), rng.randint(0, 2))),
                            loras=rng.randint(0, 2))
        images.append(image)
    return replace(inp, images=tuple(images))


@dataclass
class PackingFakeCosts(FakeCosts):
    """FakeCosts on workers that pack resolutions (`PackedForwardCosts`' two extra answers): a
    packed forward pays the fixed cost once for all its groups."""

    def packs(self, model: str) -> bool:
        return True

    def round_seconds(self, batches) -> float:
        return self.image_fixed + sum(self.image_per_row_mpx * b.rows * b.height * b.width / 1e6 for b in batches)
