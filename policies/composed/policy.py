"""The composed policy ("composed"): one decision per round over the whole pool, each seed's
scheduling mechanism a component of it, each switchable in `policy_options` (types.py).

    spine       GenServe: knapsack DP over worker counts, preemption, elastic SP   policies/genserve
    sticky      a worker's residents one batch, never moved nor parked             genserve/image_batching.py
    packing     PatchedServe's packed forward: resolutions of a model in a batch   genserve/image_batching.py
    spreading   waiting images take empty workers first; no-SLO ones the least     genserve/image_batching.py
                loaded batch
    headroom    workers kept free for the images expected within a video step      headroom.py
    refusal     PatchedServe's SLO-violation analysis (429 deadline_unattainable)  refusal.py
    cfg split   SwiftDiffusion's latent parallelism on idle workers                policies/latent_parallel.py

One round:

1. refusal (on by default): waiting requests that cannot meet their deadlines even started now
   at their fastest are discarded, with the reason (the client gets 429 deadline_unattainable);
2. headroom: the image arrival rate of the last `headroom_window_s` and the longest video step
   at degree 1 give the workers to keep free (`reserve_workers`);
3. CFG split (when on): while two idle workers beyond the reserve are left for every ready
   request, a lone CFG image whose split step pays is split over two; pairs step, or give a
   worker back once more requests wait than workers idle;
4. the spine decides for every other worker and request, scoring each reserved worker as
   RESERVE_WEIGHT, below any request's weight: SP upgrades give way to the reserve, nothing
   that serves or keeps a request does.

What is late is still served, least-late first (the spine's EDF orders the hopeless by deadline,
behind the feasible) and never behind an SP upgrade (a late image's weight is LATE_WEIGHT): a
request that ran late once admitted, or every late request with refusal off.

The seam for a per-worker sequencer (SynerDiff's UNet/VAE planner) is below the plans: a worker
with a sequencer (`vae_decoder.sequencer_profile`) orders the rounds of what it is given.
"""

from __future__ import annotations

from stepserve.policies.base import without
from stepserve.policies.composed.headroom import ImageArrivals, reserve_workers
from stepserve.policies.composed.refusal import unattainable
from stepserve.policies.composed.types import ComposedConfig
from stepserve.policies.cost_model import CostModel
from stepserve.policies.genserve.costs import MemoizedCosts
from stepserve.policies.genserve.policy import GenServePolicy
from stepserve.policies.latent_parallel import LatentParallel, LatentParallelConfig
from stepserve.policies.registry import register_policy
from stepserve.policies.types import ClusterSnapshot, Decision, RequestKind


@register_policy("composed", ComposedConfig)
class ComposedPolicy:
    name: str  # set by register_policy
    needs_costs = True
    steady = False  # the spine's slack moves with the clock
    joins_running = True
    splits_cfg = True  # per instance: only with cfg_parallel on (set in __init__)

    def __init__(self, config: ComposedConfig, costs: CostModel) -> None:
        self.config = config
        self.spine = GenServePolicy(config.spine(), costs)
        self.splitter = LatentParallel(LatentParallelConfig(config.cfg_min_gain), costs) if config.cfg_parallel \
            else None
        self.splits_cfg = config.cfg_parallel
        self.arrivals = ImageArrivals(config.headroom_window_s)
        self.profile = MemoizedCosts(costs)  # the profile alone: refusal must not learn an overload's overhead
        self.reserve = 0  # the last round's, for metrics and tests

    def schedule(self, snapshot: ClusterSnapshot) -> Decision:
        refused = unattainable(snapshot.queued, snapshot.now, self.profile, self.config.sp_degrees,
                               len(snapshot.workers)) if self.config.refuse_unattainable else ()
        if refused:
            snapshot = without(snapshot, (), (f.request_id for f in refused))
        self.reserve = self._reserve(snapshot)
        spine = _Spine(self.spine, self.reserve)
        decision = (self.splitter.around(snapshot, spine, keep_idle=self.reserve) if self.splitter is not None
                    else spine.schedule(snapshot))
        return Decision(decision.plans, decision.wake_at, refused + decision.discard) if refused else decision

    def _reserve(self, snapshot: ClusterSnapshot) -> int:
        if not self.config.headroom_quantile:
            return 0
        self.arrivals.observe(snapshot)
        video = RequestKind.T2V  # (every running request, every round: no property call)
        videos = [v for v in snapshot.queued if v.kind is video] + [v for v in snapshot.running if v.kind is video]
        if not videos:
            return 0  # nothing would take an idle worker for longer than an image's step
        horizon = max(self.profile.step_seconds_of((v.shape_key.model, v.shape_key.height, v.shape_key.width,
                                                    v.rows, v.shape_key.frames, 1)) for v in videos)
        return reserve_workers(self.arrivals.rate(snapshot.now), horizon, self.config.headroom_quantile,
                               len(snapshot.workers))


class _Spine:
    """The spine as the `Scheduler` the CFG splitter hands the rest of the pool to."""

    def __init__(self, policy: GenServePolicy, reserve: int) -> None:
        self.policy = policy
        self.reserve = reserve

    def schedule(self, snapshot: ClusterSnapshot) -> Decision:
        return self.policy.decide(snapshot, self.reserve)
