"""PatchedServe's SLO-aware scheduler (patchedserve.txt §6, Algorithm 1) as the policy "patchedserve".

    §6.2 slack score Slack_i = (DDL_i - C_i - P_i) / SA_i           slack.py
    §6.1 Throughput Analyzer: an MLP over rows per resolution,      predictor.py, on the dataset
         distinct resolutions and total patches, trained on the     of samples.py; latency.py
         profile's measured batches (the cost model fills the rest)
    §4   one forward over several resolutions, priced               mixed_costs.py
    Alg. 1 lines 8-12: SLO violation analysis, discard              here, with slack.time_out
    Alg. 1 lines 15-19: schedule mode (throughput when slack is loose) here
    Alg. 1 lines 22-24: schedulability test                         schedulability.py
    §8.2 data parallelism: each request to one GPU                  here (placement)

(Line numbers as the listing prints them; §6.2's text cites 6-9, 11-14 and 16-18.)

One round, over the whole pool (`decide_round`):

1. SLO violation analysis: a waiting request that would miss its deadline even started now
   alone on an idle worker is discarded (`Decision.discard`, with the reason: the router fails it).
2. Ready requests are ranked by slack (their P: the remaining steps alone, since where they
   will run is not decided yet). A request goes to the worker where it is predicted to finish
   first, among those with room where it makes no active request miss: the paper's data
   parallelism sends each request to the GPU with the lowest workload (§8.2), and a request
   batched there steps at that batch's pace. While some worker has room:
   - Urgent mode (the least slack at most `throughput_slack`): the least-slack request. If it
     would miss its deadline on every worker with room it is discarded (lines 8-12: it cannot
     meet its deadline even if processed now); if it meets it only where it would make an
     active request miss, admission stops for the round (lines 22-24).
   - Throughput mode: the request whose admission buys the most: its standalone step over the
     step time it adds where it goes (above 1 it batches for less than it costs alone), the
     least slack first among equals, of those that meet their deadlines there; none: stop.
3. Every open worker steps all its residents, one `StepGroup` per shape (workers that pack
   resolutions run them as one forward: `workers.pack_resolutions`; the router then prices
   rounds with `PackedForwardCosts`, and so does this policy, which prices with what it is given).

A request placed on a worker that is not open (its pipeline is full; it opens within a step)
waits for it: it counts in that worker's batch for the rest of the round, and the round in
which the worker opens decides again. Requests that differ only in their deadlines and
arrivals fare alike on a worker, so each worker's prediction is made once per class of request
(`_class_of`) and batch. Every prediction adds the router's measured step overhead
(`ClusterSnapshot.step_overhead_s`), as the GenServe policy does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepserve.policies.base import batch_limit, group_by_shape, residents_of
from stepserve.policies.cost_model import CostModel
from stepserve.policies.patchedserve.latency import BatchLatency
from stepserve.policies.patchedserve.predictor import HoldoutReport, ThroughputAnalyzer, holdout_error
from stepserve.policies.patchedserve.samples import measured_samples, training_samples
from stepserve.policies.patchedserve.schedulability import finish_times, harmed
from stepserve.policies.patchedserve.slack import request_slack, time_out
from stepserve.policies.patchedserve.types import PatchedServeConfig, Predictor
from stepserve.policies.registry import register_policy
from stepserve.policies.types import (ClusterSnapshot, Decision, RequestFailure, RequestKind, RequestView, WorkerPlan,
                                      WorkerView)


@dataclass(frozen=True)
class _Option:
    """A request of some class (`_class_of`) admitted to `worker`'s batch: what that predicts."""

    worker: WorkerView
    end: float  # the request's predicted end of denoising
    safe: bool  # no member that met its deadline misses it
    gain: float  # the request's standalone step over the step time it adds


def decide_round(snapshot: ClusterSnapshot, config: PatchedServeConfig, latency: BatchLatency) -> Decision:
    """One round of Algorithm 1 over the pool (see the module docstring)."""
    now = snapshot.now
    # The router's measured step overhead is learned from the plans it runs. On an idle pool it
    # is what the last load left, and nothing runs to correct it: counted then, an overhead
    # learned under overload would discard every request and never come down (seen live: every
    # request of a 10 req/s run discarded after an overloaded 8 req/s one). So an idle pool
    # predicts from the profile alone, and the first plans it runs measure the overhead again.
    extra = snapshot.overhead_s(RequestKind.T2I) if snapshot.running else 0.0

    def step(views: Sequence[RequestView]) -> float:
        return latency.step_seconds(views) + extra if views else 0.0

    workers = snapshot.workers
    limit = {w.worker_id: batch_limit(w, config.max_batch_size) for w in workers}
    batch = {w.worker_id: list(snapshot.running_on(w.worker_id)) for w in workers}
    # A busy worker starts what it is given after the step it is running (the views count that
    # step as done already): its batch's predictions start one step of it later.
    start = {w.worker_id: now + step(batch[w.worker_id]) if w.busy else now for w in workers}
    finish = {wid: finish_times(views, start[wid], step) for wid, views in batch.items()}
    admitted: dict[str, list[RequestView]] = {w.worker_id: [] for w in workers}
    discard: list[RequestFailure] = []
    slack: dict[str, float] = {}
    waiting: list[RequestView] = []
    for view in snapshot.queued:
        alone = view.steps_left * step([view])
        if time_out(view, now, alone):
            discard.append(_give_up(view, now + alone, "even started now alone on an idle worker"))
        elif view.ready:
            slack[view.request_id] = request_slack(view, now, alone, view.steps_total * step([view]))
            waiting.append(view)
    waiting.sort(key=lambda v: (slack[v.request_id], v.arrival_time, v.request_id))
    options: dict[tuple[tuple, str], _Option] = {}  # (class of request, worker) -> option

    def option(view: RequestView, worker: WorkerView) -> _Option:
        key = (_class_of(view), worker.worker_id)
        found = options.get(key)
        if found is None:
            members = batch[worker.worker_id]
            after = finish_times([*members, view], start[worker.worker_id], step)
            added = step([*members, view]) - step(members)
            found = options[key] = _Option(worker, after[view.request_id],
                                           not harmed(members, finish[worker.worker_id], after),
                                           step([view]) / max(added, 1e-12))
        return found

    def where(view: RequestView, room: list[WorkerView]) -> _Option | None:
        """The worker with room, harming no one, where `view` finishes first."""
        safe = [o for o in (option(view, w) for w in room) if o.safe]
        return min(safe, key=lambda o: (o.end, not o.worker.open, o.worker.rank)) if safe else None

    while waiting:
        room = [w for w in workers if len(batch[w.worker_id]) < limit[w.worker_id]]
        if not room:
            break
        cur = waiting[0]
        if slack[cur.request_id] > config.throughput_slack:
            best: tuple[float, RequestView, _Option] | None = None
            for view in waiting:
                choice = where(view, room)
                if choice is not None and choice.end <= view.deadline and (best is None or choice.gain > best[0]):
                    best = (choice.gain, view, choice)
            if best is None:
                break
            _, cur, choice = best
        else:
            soonest = min(option(cur, w).end for w in room)
            if soonest > cur.deadline:
                discard.append(_give_up(cur, soonest, "on any worker with room now"))
                waiting.pop(0)
                continue
            choice = where(cur, room)
            if choice is None or choice.end > cur.deadline:
                break
        wid = choice.worker.worker_id
        batch[wid].append(cur)
        finish[wid] = finish_times(batch[wid], start[wid], step)
        options = {key: o for key, o in options.items() if key[1] != wid}
        if choice.worker.open:
            admitted[wid].append(cur)
        waiting.remove(cur)

    plans = []
    for worker in snapshot.open_workers():
        wid = worker.worker_id
        residents = residents_of(snapshot, wid)
        if residents or admitted[wid]:
            plans.append(WorkerPlan(wid, admit=tuple(v.request_id for v in admitted[wid]),
                                    groups=group_by_shape(residents + admitted[wid])))
    return Decision(tuple(plans), discard=tuple(discard))


def _class_of(view: RequestView) -> tuple:
    """What a request's predicted pace and stay depend on: requests equal in it differ only in
    their deadlines and arrivals."""
    return (view.kind, view.shape_key, view.rows, view.steps_left, view.loras, view.mask_ratio,
            view.template_id is not None)


def _give_up(view: RequestView, predicted_end: float, where: str) -> RequestFailure:
    return RequestFailure(view.request_id, f"cannot meet its deadline: {where} it would end denoising "
                                           f"{predicted_end - view.deadline:.2f} s after it")


@register_policy("patchedserve", PatchedServeConfig)
class PatchedServePolicy:
    name: str  # set by register_policy
    needs_costs = True
    # A worker's plan changes with the clock only in what it admits, and while something waits
    # that a worker has room for the router keeps plans to one step (`joins_running`): a plan of
    # several steps is one the clock would not change.
    steady = True
    joins_running = True
    splits_cfg = False

    def __init__(self, config: PatchedServeConfig, costs: CostModel) -> None:
        """Trains a Throughput Analyzer for every model `costs` lists (`ProfiledCostModel.models`,
        wrapped or not) on the batches its profile measured (`ProfiledCostModel.profile_rows`) and
        the ones `costs` fills in. `holdout` keeps each one's error on 20% of the measured batches
        held out of a first fit; the analyzer served is fitted on all of them, since a measured
        batch left out is a corner of the grid it would price from its neighbours alone."""
        self.config = config
        self.pricing = costs
        self.holdout: dict[str, HoldoutReport] = {}
        analyzers: dict[str, ThroughputAnalyzer] = {}
        if config.predictor is Predictor.MLP:
            for model in getattr(costs, "models", ()):  # only a profiled model lists them, and has rows
                measured = measured_samples(costs.profile_rows, model, config.sizes,  # type: ignore[attr-defined]
                                            costs.round_overhead_seconds)  # type: ignore[attr-defined]
                samples = training_samples(self.pricing, model, config.sizes, config.training_batch,
                                           config.training_samples, config.seed, measured)
                analyzers[model], self.holdout[model] = holdout_error(samples, config.seed)
                if self.holdout[model].train < len(samples):  # some were held out: the served fit sees them
                    analyzers[model] = ThroughputAnalyzer.fit(samples, seed=config.seed)
        self.latency = BatchLatency(self.pricing, analyzers)

    def schedule(self, snapshot: ClusterSnapshot) -> Decision:
        return decide_round(snapshot, self.config, self.latency)
