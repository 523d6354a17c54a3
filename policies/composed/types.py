"""The composed policy's options: each paper's mechanism a switch, for ablations."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stepserve.policies.genserve.types import GenServeConfig


@dataclass(frozen=True)
class ComposedConfig:
    """`policy_options` of the policy "composed"; the defaults are the whole design."""

    # The spine: GenServe's per-round knapsack DP, step-boundary preemption and elastic SP
    # (GenServeConfig's fields of the same names).
    sp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    image_max_batch: int = 8
    round_s: float = 1.0
    preemption: bool = True
    dp: bool = True
    elastic_sp: bool = True
    # A resident image is batched only with its own worker's (GenServeConfig.sticky_images): no
    # image moves to form a batch, which on a busy pool costs each moved image a round.
    sticky_images: bool = True
    # A worker inside a step admits waiting images into its batch's room at its next plan
    # (GenServeConfig.admit_busy), as continuous batching does under the router's pipelining.
    admit_busy: bool = True
    # PatchedServe's packed forward: images of one model and several resolutions share a batch
    # (GenServeConfig.pack_resolutions). Unset in a serve config, it is workers.pack_resolutions
    # (`policies.options_for_workers`): the policy packs where the workers do.
    pack_resolutions: bool = False
    # Waiting images take empty workers before they join batches (GenServeConfig.spread_images).
    spread_images: bool = True
    # Headroom (headroom.py): keep this quantile of the images expected within a video step's
    # time free of SP upgrades; 0 switches it off (GenServe as published).
    headroom_quantile: float = 0.99
    headroom_window_s: float = 60.0  # the arrivals that set the expected image rate
    # SwiftDiffusion's latent (CFG) parallelism: a lone CFG image split over two idle workers,
    # where the cost model prices the split step at most (1 - cfg_min_gain) of the whole one.
    cfg_parallel: bool = True
    cfg_min_gain: float = 0.05
    # PatchedServe's SLO-violation analysis: a waiting request that would miss its deadline even
    # started now at its fastest is refused (429 deadline_unattainable, which a client may retry)
    # instead of served late; its work goes to requests that can still make theirs. Off: every
    # request is served, the late least-late first. Requests without an SLO are never refused.
    refuse_unattainable: bool = True

    def __post_init__(self) -> None:
        self.spine()  # the spine's checks, named by their fields
        if not 0.0 <= self.headroom_quantile < 1.0:
            raise ValueError(f"headroom_quantile must be in [0, 1), got {self.headroom_quantile!r}")
        if not (isinstance(self.headroom_window_s, (int, float)) and math.isfinite(self.headroom_window_s)
                and self.headroom_window_s > 0):
            raise ValueError(f"headroom_window_s must be a positive number, got {self.headroom_window_s!r}")
        if not 0.0 <= self.cfg_min_gain < 1.0:
            raise ValueError(f"cfg_min_gain must be in [0, 1), got {self.cfg_min_gain!r}")
        for name in ("preemption", "dp", "elastic_sp", "sticky_images", "admit_busy", "pack_resolutions",
                     "spread_images", "cfg_parallel", "refuse_unattainable"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def spine(self) -> GenServeConfig:
        return GenServeConfig(sp_degrees=self.sp_degrees, image_max_batch=self.image_max_batch,
                              round_s=self.round_s, preemption=self.preemption, dp=self.dp,
                              elastic_sp=self.elastic_sp, sticky_images=self.sticky_images,
                              admit_busy=self.admit_busy, pack_resolutions=self.pack_resolutions,
                              spread_images=self.spread_images)
