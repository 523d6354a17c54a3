"""Stage 1/2 for images: EDFBATCH (GenServe Algorithm 1, line 3; Eq. (6); §4.3 "SLO-aware
dynamic batching").

Images are taken earliest deadline first and packed into batches of one shape key (same model
and resolution, the only images that can share a forward). An image joins a batch only if the
profiler's latency for the enlarged batch keeps every member that was on time on time: the
batch's deadline is its tightest member's. Batches are ranked by their most urgent member, so
"the best image plan on g workers" is simply the first g batches, which lets the knapsack price
every worker budget g = 0..N from one pass.

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
from stepserve.policies.genserve.scoring import RESERVE_WEIGHT, Value, add, micros, slack_weight, wait_value
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
                n_workers: int, reserve: int = 0) -> ImagePlan:
    # Hot path (every round, every image): shape keys become plain tuples and step costs are
    # looked up by StepKey, so no frozen dataclass is built or hashed per image.
    step_cost = memoized(costs).step_seconds_of

    def step_of(kt: tuple[str, int, int, int], rows: int) -> float:
        return step_cost((kt[0], kt[1], kt[2], rows, kt[3], 1))

    entries = []
    unbatchable: list[ImageRequest] = []
    for image in images:
        k = image.shape_key
        kt = (k.model, k.height, k.width, k.frames)
        solo = step_of(kt, image.rows)
        if not (solo >= 0 and math.isfinite(solo)):
            unbatchable.append(image)
            continue
        # Late even alone: to the back of the order (ids are unique, so the image itself is
        # never compared).
        hopeless = now + image.steps_left * solo > image.deadline
        entries.append((hopeless, image.deadline, image.arrival_time, image.request_id, image, kt, solo))
    entries.sort()

    # An open batch: [kt, members, rows, step_s, allowance, closed]. `allowance` is the largest
    # step time that keeps every on-time member on time, so a join is checked in O(1). `closed`:
    # the fewest rows a join was refused for by the allowance; rows only grow and the allowance
    # only shrinks, so an image of as many rows is refused again and is not priced (on a large
    # pool most open batches are closed to most images). A full batch leaves the open list.
    # `home`: with `sticky_images`, the worker its resident members live on (None while it has
    # none): a resident joins only a batch of its own worker, so no batch moves a resident.
    open_by_key: dict[tuple[str, int, int, int], list[list]] = {}
    created: list[list] = []
    max_batch = config.image_max_batch
    sticky = config.sticky_images
    for hopeless, deadline, _, _, image, kt, solo in entries:
        mine = (deadline - now) / image.steps_left
        rows = image.rows
        here = image.worker_id if sticky else None
        opened = open_by_key.get(kt, ())
        for batch in opened:
            if rows >= batch[5] or (here is not None and batch[6] not in (None, here)):
                continue
            members = batch[1]
            t = step_of(kt, batch[2] + rows)
            # Joining must not make an on-time member late, nor this image, unless it is late
            # even alone (then a batch slot costs nobody anything).
            if t > batch[4]:
                batch[5] = rows
            elif hopeless or t <= mine:
                members.append((image, solo))
                batch[2] += rows
                batch[3] = t
                if not hopeless and mine < batch[4]:
                    batch[4] = mine
                if here is not None:
                    batch[6] = here
                if len(members) >= max_batch:
                    opened.remove(batch)
                break
        else:
            batch = [kt, [(image, solo)], rows, solo, math.inf if hopeless else mine, math.inf, here]
            if max_batch > 1:
                open_by_key.setdefault(kt, []).append(batch)
            created.append(batch)

    round_s = config.round_s
    planned: list[PlannedBatch] = []
    for _, members, rows, step_s, _, _, _ in created:
        # run_value and wait_value written out (with the weight shared between them): this is
        # the per-image inner loop of every round. score_plan recomputes the same numbers
        # through the scoring functions, and the tests hold the two equal.
        pm = pu = pr = wm = wr = 0
        for m, solo in members:
            deadline, steps = m.deadline, m.steps_left
            best_s = steps * solo
            weight = slack_weight(deadline - now - best_s)
            run_s = steps * step_s
            wait_s = round_s + best_s
            recoverable = now + wait_s <= deadline
            if recoverable or now + run_s <= deadline:
                pm += 1
            if recoverable:
                wm += 1
            pu += weight
            pr -= weight * micros(run_s)
            wr -= weight * micros(wait_s)
        first = members[0][0]
        planned.append(PlannedBatch(first.shape_key, tuple(m for m, _ in members), rows, step_s,
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
