"""Stage 1/2 for images: EDFBATCH (GenServe Algorithm 1, line 3; Eq. (6); §4.3 "SLO-aware
dynamic batching").

Images are taken earliest deadline first and packed into batches of one shape key (same model
and resolution, the only images that can share a plain forward; with `pack_resolutions`, of one
model: PatchedServe's packed forward runs several resolutions in one, priced as the cost model
prices it). An image joins a batch only if the profiler's latency for the enlarged batch,
add-ons included (its ControlNet calls and LoRA updates: SwiftDiffusion; images with add-ons are
not packed), keeps every member that was on time on time: the batch's deadline is its tightest
member's. Batches are ranked by their most urgent member, so "the best image plan on g workers"
is simply the first g batches, which lets the knapsack price every worker budget g = 0..N from
one pass.

Images that cannot meet their deadline even alone go to the back of the order: under plain EDF
a late request would sit at the head and make the ones behind it late too.

`reserve` workers beyond the batches are worth RESERVE_WEIGHT each (scoring.py): kept free for
images expected to arrive, which would otherwise wait a video step for a worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from stepserve.policies.genserve.costs import StepCosts, memoized
from stepserve.policies.genserve.scoring import (LATE_WEIGHT, MAX_SECONDS, RESERVE_WEIGHT, SCALE, Value, add,
                                                 wait_value)
from stepserve.policies.genserve.types import GenServeConfig, ImageRequest
from stepserve.policies.types import ShapeKey


class PlannedBatch(NamedTuple):  # a NamedTuple: built per batch per round, and cheap
    shape_key: ShapeKey
    members: tuple[ImageRequest, ...]  # earliest deadline first
    rows: int
    step_s: float  # T_img for the whole batch
    placed_value: Value  # the members' score if this batch runs this round
    waiting_value: Value  # their score if it does not


@dataclass(frozen=True)
class ImagePlan:
    batches: tuple[PlannedBatch, ...]  # priority order: batch k gets a worker before batch k+1
    prefix: tuple[Value, ...]  # prefix[g]: score of all images when the first g batches run
    unbatchable: tuple[ImageRequest, ...]  # no finite step cost: they never run

    def value(self, workers: int) -> Value:
        """The images' score when the first `workers` batches run."""
        return self.prefix[min(workers, len(self.prefix) - 1)]

    def value_of(self, placed: Iterable[int]) -> Value:
        """The images' score when exactly the batches `placed` run (any subset, not a prefix)."""
        total = self.prefix[0]
        for k in placed:
            b = self.batches[k]
            total = add(total, (b.placed_value[0] - b.waiting_value[0], b.placed_value[1] - b.waiting_value[1],
                                b.placed_value[2] - b.waiting_value[2]))
        return total


def edf_batches(images: Iterable[ImageRequest], now: float, config: GenServeConfig, costs: StepCosts,
                n_workers: int, reserve: int = 0, spread: int = 0) -> ImagePlan:
    """With `spread_images`, the first `spread` batches of waiting images are opened without
    joining others (they will have empty workers of their own), and a waiting image without an
    SLO then joins the batch it steps fastest in (the least loaded), not the first that takes it."""
    # Hot path (every round, every image): shape keys become plain tuples and step costs are
    # looked up by StepKey, so no frozen dataclass is built or hashed per image.
    memo = memoized(costs)
    step_cost = memo.step_seconds_of
    image_step = memo.image_step_of
    packing = config.pack_resolutions

    def step_of(kt: tuple[str, int, int, int], rows: int, computed: float) -> float:
        if computed >= rows:
            return step_cost((kt[0], kt[1], kt[2], rows, kt[3], 1))
        return image_step(kt[0], kt[1], kt[2], rows, computed)

    def priced(kt: tuple[str, int, int, int], rows: int, computed: float, addons: list | None) -> float:
        """`step_of` with add-ons: [rows by ControlNet, LoRA rows] (None: none)."""
        if addons is None:
            return step_of(kt, rows, computed)
        return image_step(kt[0], kt[1], kt[2], rows, computed, tuple(sorted(addons[0].values())), addons[1])

    def grown(batch: list, kt: tuple[str, int, int, int], rows: int, computed: float, addons: list | None) -> float:
        """The batch's step with `rows` more of shape `kt`, `computed` of them computed, with
        `addons` (one packed forward over its shapes: only images without add-ons pack)."""
        groups = batch[6]
        if groups is None or (len(groups) == 1 and kt in groups):
            if addons is None and batch[8] is None:
                return step_of(kt, batch[2] + rows, batch[7] + computed)
            return priced(kt, batch[2] + rows, batch[7] + computed, _merged(batch[8], addons))
        sizes = dict(groups)
        sizes[kt] = sizes.get(kt, 0) + rows
        return memo.packed_step_of(kt[0], tuple(sorted((k[1], k[2], r) for k, r in sizes.items())))

    entries = []
    unbatchable: list[ImageRequest] = []
    work = 0.0  # every batchable image's steps left at its solo step: the images' work, in seconds
    for image in images:
        k = image.shape_key
        kt = (k.model, k.height, k.width, k.frames)
        computed = image.rows * image.computed_share
        # Add-ons (SwiftDiffusion): the ControlNet calls and LoRA updates its rows add to a
        # forward, priced with the batch's; None for a plain image (the hot path).
        addons = ([{name: image.rows for name in image.controlnets}, image.rows * image.loras]
                  if image.controlnets or image.loras else None)
        solo = priced(kt, image.rows, computed, addons)
        if not (solo >= 0 and math.isfinite(solo)):
            unbatchable.append(image)
            continue
        # Late even alone: to the back of the order (ids are unique, so the image itself is
        # never compared). With `sticky_images` residents come first, in deadline order late or
        # not: their batches hold their workers already (a batch that displaced them would
        # export each, a pause apiece), and a late one ranked behind new work would sit there,
        # holding room and its client, for as long as the load lasts (seen: 170 s at 6 req/s).
        # Formed first, a worker's batch is whole before a waiting image is checked against it.
        hopeless = now + image.steps_left * solo > image.deadline
        resident = config.sticky_images and image.worker_id is not None
        # The batch key: the shape, or with packing the model (all its resolutions, one forward;
        # a packed forward computes every token and runs no add-on, so an edit of a cached
        # template or an image with add-ons is not packed: `patchedserve.mixed_costs.packable`).
        bt = (k.model, 0, 0, 1) if packing and memo.packs(k.model) and computed >= image.rows and addons is None \
            else kt
        entries.append((not resident, hopeless and not resident, image.deadline, image.arrival_time,
                        image.request_id, image, kt, solo, hopeless, bt, computed, addons))
        work += image.steps_left * solo
    entries.sort()

    # An open batch: [key, members, rows, step_s, allowance, closed, groups, computed, addons, work].
    # `allowance` is the largest step time that keeps every on-time member on time, so a join is
    # checked in O(1). `closed`: the fewest rows of an image computing all its tokens that a join
    # was refused for by the allowance; rows only grow and the allowance only shrinks, so another
    # such image of as many rows is refused again and is not priced, with add-ons or not (they
    # only add to a step; on a large pool most open batches are closed to most images; a packed
    # batch's rows differ in price by resolution, so it keeps none; an edit computing less is
    # always priced). A full batch leaves the open list.
    # `groups`: a packed batch's rows by shape, None for a batch of one shape. `computed`: its
    # rows weighted by their computed share (below `rows` where edits of cached templates
    # compute less: InstGenIE). `addons`: its rows by ControlNet and its LoRA rows, None if none.
    # `work`: its members' steps left at their solo steps.
    # `homes`, with `sticky_images`: each worker's batch of its residents of one key. They are
    # one batch whatever the allowance: they were admitted together, and split, the batch that
    # does not get their worker could only move its members (a pause each) or leave them parked.
    # Waiting images join it as any batch.
    open_by_key: dict[tuple[str, int, int, int], list[list]] = {}
    homes: dict[tuple[str, tuple[str, int, int, int]], list] = {}
    created: list[list] = []
    max_batch = config.image_max_batch
    sticky = config.sticky_images
    fresh = 0  # batches opened by waiting images
    spreading = config.spread_images
    fair = _fair_share(entries, work, now, n_workers) if spreading else math.inf

    def open_batch(image: ImageRequest, solo: float, kt: tuple, rows: int, hopeless: bool, mine: float,
                   bt: tuple, computed: float, addons: list | None) -> list:
        batch = [bt, [(image, solo)], rows, solo, math.inf if hopeless else mine, math.inf,
                 None if bt == kt else {kt: rows}, computed, addons, image.steps_left * solo]
        if max_batch > 1:
            open_by_key.setdefault(bt, []).append(batch)
        created.append(batch)
        return batch

    for _, _, deadline, _, _, image, kt, solo, hopeless, bt, computed, addons in entries:
        mine = (deadline - now) / image.steps_left
        rows = image.rows
        here = image.worker_id if sticky else None
        if here is not None:
            # A resident (all come before any waiting image): its worker's batch, whatever the
            # allowance, or a new one when it has none yet or that one is full. Never another
            # worker's, so no open batch need be looked at (on a large pool, every one of them).
            batch = homes.get((here, bt))
            if batch is None or len(batch[1]) >= max_batch:
                homes[(here, bt)] = open_batch(image, solo, kt, rows, hopeless, mine, bt, computed, addons)
            else:
                _join(batch, image, solo, kt, rows, computed, grown(batch, kt, rows, computed, addons), hopeless, mine,
                      addons)
                if len(batch[1]) >= max_batch:
                    _close(open_by_key.get(bt, []), batch)
            continue
        opened = open_by_key.get(bt, ()) if fresh >= spread else ()
        full = computed >= rows
        chosen, chosen_t = None, math.inf
        least = spreading and mine == math.inf
        for batch in opened:
            if rows >= batch[5] and full or least and batch[9] > fair:
                continue
            t = grown(batch, kt, rows, computed, addons)
            # Joining must not make an on-time member late, nor this image, unless it is late
            # even alone (then a batch slot costs nobody anything).
            if t > batch[4]:
                if batch[6] is None and full and addons is None:
                    batch[5] = rows
            elif (hopeless or t <= mine) and t < chosen_t:
                chosen, chosen_t = batch, t
                if not spreading or mine < math.inf:
                    break  # EDF batching: the first batch that takes it
        if chosen is not None:
            _join(chosen, image, solo, kt, rows, computed, chosen_t, hopeless, mine, addons)
            if len(chosen[1]) >= max_batch:
                _close(opened, chosen)
        else:
            open_batch(image, solo, kt, rows, hopeless, mine, bt, computed, addons)
            fresh += 1

    round_s = config.round_s
    planned: list[PlannedBatch] = []
    for _, members, rows, step_s, _, _, _, _, _, _ in created:
        # run_value and wait_value written out (with the weight shared between them): this is
        # the per-image inner loop of every round. score_plan recomputes the same numbers
        # through the scoring functions, and the tests hold the two equal.
        # slack_weight and micros inlined too (two calls an image a round, at 512 workers ~5%
        # of the decision).
        pm = pu = pr = wm = wr = 0
        for m, solo in members:
            deadline, steps = m.deadline, m.steps_left
            best_s = steps * solo
            slack = deadline - now - best_s
            if 0.0 <= slack < math.inf:
                weight = round(SCALE / (1.0 + slack))
                if weight < LATE_WEIGHT:
                    weight = LATE_WEIGHT
            else:
                weight = LATE_WEIGHT
            run_s = steps * step_s
            wait_s = round_s + best_s
            recoverable = now + wait_s <= deadline
            if recoverable or now + run_s <= deadline:
                pm += 1
            if recoverable:
                wm += 1
            pu += weight
            pr -= weight * round((run_s if run_s < MAX_SECONDS else MAX_SECONDS) * SCALE)
            wr -= weight * round((wait_s if wait_s < MAX_SECONDS else MAX_SECONDS) * SCALE)
        first = members[0][0]
        planned.append(PlannedBatch(first.shape_key, tuple([m for m, _ in members]), rows, step_s,
                                    (pm, pu, pr), (wm, 0, wr)))

    # Images without a cost never run; they still count (as missed, or met if no SLO) so that
    # every plan is scored over the same requests.
    tm = tu = tr = 0
    for b in planned:
        tm += b.waiting_value[0]
        tr += b.waiting_value[2]
    for image in unbatchable:
        wait = wait_value(image.deadline, now, math.inf, round_s)
        tm += wait[0]
        tr += wait[2]
    prefix = [(tm, tu, tr)]
    for b in planned[:n_workers]:
        tm += b.placed_value[0] - b.waiting_value[0]
        tu += b.placed_value[1]
        tr += b.placed_value[2] - b.waiting_value[2]
        prefix.append((tm, tu, tr))
    for _ in range(min(reserve, n_workers + 1 - len(prefix))):
        tu += RESERVE_WEIGHT
        prefix.append((tm, tu, tr))
    prefix.extend([prefix[-1]] * (n_workers + 1 - len(prefix)))
    return ImagePlan(tuple(planned), tuple(prefix), tuple(unbatchable))


def _join(batch: list, image: ImageRequest, solo: float, kt: tuple[str, int, int, int], rows: int, computed: float,
          step_s: float, hopeless: bool, mine: float, addons: list | None) -> None:
    batch[1].append((image, solo))
    batch[2] += rows
    batch[7] += computed
    batch[3] = step_s
    batch[9] += image.steps_left * solo
    if addons is not None:
        batch[8] = _merged(batch[8], addons)
    if not hopeless and mine < batch[4]:
        batch[4] = mine
    if batch[6] is not None:
        batch[6][kt] = batch[6].get(kt, 0) + rows


def _fair_share(entries: list[tuple], work: float, now: float, n_workers: int) -> float:
    """A worker's share of the images' work, present and expected, in solo seconds: the most a
    batch may hold for an image without an SLO to join it (with `spread_images`).

    At the end of a burst the last images then spread over the workers as they free up instead
    of filling the batch of the first one to free (seen: a last wave of 8 on some workers and
    none on others, the makespan 5% longer than continuous batching's). While images keep
    arriving, the work expected within a waiting image's run (taken to be what arrived within
    the last one) counts too: new images will fill the workers left lighter, so joining now
    wastes nothing (without it InstGenIE's edits near saturation waited for fresh batches: P95
    +8% against mask_aware's)."""
    waiting = [e[7] * e[5].steps_left for e in entries if e[0] and e[2] == math.inf]
    if not waiting or not n_workers:
        return math.inf
    horizon = sum(waiting) / len(waiting)
    expected = sum(e[7] * e[5].steps_left for e in entries if e[3] > now - horizon)
    return (work + expected) / n_workers


def _merged(held: list | None, more: list | None) -> list | None:
    """Add-ons (`[rows by ControlNet, LoRA rows]`) of a batch and of an image joining it, as new."""
    if more is None or held is None:
        return held if more is None else [dict(more[0]), more[1]]
    calls = dict(held[0])
    for name, rows in more[0].items():
        calls[name] = calls.get(name, 0) + rows
    return [calls, held[1] + more[1]]


def _close(opened: list[list], batch: list) -> None:
    """Drop a full batch from the open list, by identity: `list.remove` would compare batches by
    value, member by member, against every batch before it."""
    for i, other in enumerate(opened):
        if other is batch:
            del opened[i]
            return
