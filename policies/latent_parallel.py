"""Latent parallelism (SwiftDiffusion §4.3): a CFG request's unconditional and conditional rows on
two workers at once where that pays; step-level continuous batching for everything else.

A split step runs one row on each of two workers and swaps their noise predictions
(`engine/parallel/latent.py`): it shortens the request's step (the paper: 1.36x for SDXL on an
H800, more on slower GPUs) at the price of a second worker, so it buys latency while workers
would idle and costs throughput once they would not ("a single latent does not saturate a GPU").
Each round:

1. a split request steps on its pair, both workers at once (the exchange is a collective); a pair
   holds nothing else, and a pair with a worker not open waits for it. While more ready requests
   wait than workers are idle, pairs go back to one worker each, the longest first: both workers
   hold the whole request, so one goes on alone and the other releases it (nothing moves);
2. while two idle workers are left for every ready request still waiting, the oldest ready CFG
   image whose split step the cost model prices at most (1 - `min_gain`) of its step on one worker
   is admitted on two idle workers and split;
3. every other worker runs continuous batching (`policies/continuous.py`) over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.policies.base import PerWorker, Scheduler, check_batch_cap, without
from stepserve.policies.continuous import ContinuousBatching, ContinuousConfig
from stepserve.policies.cost_model import BatchShape, CostModel
from stepserve.policies.registry import register_policy
from stepserve.policies.types import (
    ClusterSnapshot,
    Decision,
    GroupSplit,
    RequestKind,
    RequestView,
    ShapeKey,
    StepGroup,
    WorkerPlan,
)


@dataclass(frozen=True)
class LatentParallelConfig:
    # Split only where a split step is at least this much shorter than the step on one worker.
    min_gain: float = 0.05
    max_batch_size: int | None = None  # of the continuous batching of what is not split

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        check_batch_cap("max_batch_size", self.max_batch_size)


@register_policy("latent_parallel", LatentParallelConfig)
class LatentParallel:
    name: str  # set by register_policy
    steady = True  # a plan changes only when a request arrives or leaves, or a worker opens
    joins_running = True
    splits_cfg = True
    needs_costs = True

    def __init__(self, config: LatentParallelConfig, costs: CostModel) -> None:
        self.config = config
        self.costs = costs
        self.rest = PerWorker(ContinuousBatching(ContinuousConfig(config.max_batch_size)))
        self._pays: dict[ShapeKey, bool] = {}

    def schedule(self, snapshot: ClusterSnapshot) -> Decision:
        return self.around(snapshot, self.rest)

    def around(self, snapshot: ClusterSnapshot, rest: Scheduler, keep_idle: int = 0) -> Decision:
        """Splits and pairs as the module docstring says, `rest` deciding for everything else;
        a split leaves at least `keep_idle` idle workers (the composed policy's headroom)."""
        if not snapshot.sp_available:  # the workers' world is down: nothing can split
            return rest.schedule(snapshot)
        idle = list(snapshot.index.open_idle_ids)
        ready = [v for v in snapshot.queued if v.ready]
        # Every round walks the running requests: at 512 workers thousands, so the test is
        # written out (no property calls), and workers are looked up in the index directly.
        video = RequestKind.T2V
        pairs = [v for v in snapshot.running if len(v.workers) == 2 and v.kind is not video]
        workers = snapshot.lookups().workers_by_id
        # More ready requests than idle workers: give back a worker of the pairs that would hold
        # theirs longest (each holds all of its request: the other goes on alone).
        ungroup = max(0, len(ready) - len(idle))
        plans: list[WorkerPlan] = []
        spoken: list[str] = []  # workers planned here
        for view in sorted(pairs, key=lambda v: v.steps_total - v.steps_done, reverse=True):  # steps left
            first, second = view.workers
            spoken += view.workers
            if not (workers[first].open and workers[second].open):
                continue  # the forwards run in lockstep: a pair waits for both
            if ungroup:
                ungroup -= 1  # the first keeps it (rank order)
                plans += [WorkerPlan(first, groups=(StepGroup((view.request_id,)),)),
                          WorkerPlan(second, release=(view.request_id,))]
            else:
                plans += self._split(snapshot, view, view.workers, admit=False)
        split: list[str] = []
        for i, view in enumerate(ready):
            if len(idle) - keep_idle < 2 * (len(ready) - i):
                break
            if view.uses_cfg and not view.is_video and self._split_pays(view.shape_key):
                pair, idle = tuple(idle[:2]), idle[2:]
                spoken += pair
                split.append(view.request_id)
                plans += self._split(snapshot, view, pair, admit=True)
        if not spoken:
            return rest.schedule(snapshot)
        others = rest.schedule(without(snapshot, spoken, split))
        return Decision(tuple(plans) + others.plans, others.wake_at, others.discard)

    def _split(self, snapshot: ClusterSnapshot, view: RequestView, pair: tuple[str, ...],
               admit: bool) -> list[WorkerPlan]:
        ranks = tuple(sorted(snapshot.worker(w).rank for w in pair))
        group = StepGroup((view.request_id,), ranks, GroupSplit.CFG)
        return [WorkerPlan(w, admit=(view.request_id,) if admit else (), groups=(group,)) for w in pair]

    def _split_pays(self, key: ShapeKey) -> bool:
        pays = self._pays.get(key)
        if pays is None:
            whole = BatchShape(key.model, key.height, key.width, 2, key.frames)
            split = self.costs.step_seconds(BatchShape(key.model, key.height, key.width, 2, key.frames,
                                                       cfg_split=True))
            pays = self._pays[key] = split <= (1.0 - self.config.min_gain) * self.costs.step_seconds(whole)
        return pays
