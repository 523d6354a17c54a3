"""MATERIALIZEALLOCATIONS (GenServe Algorithm 1, line 17): degrees and batch counts become
concrete worker ids.

The solver decided how many workers each video and how many image batches get; any disjoint
choice scores the same, so this step only keeps assignments stable from round to round:

1. a running video keeps its own workers (a prefix of its group when it shrinks, its group
   plus new workers when it grows), so a KEEP really is a no-op for the router;
2. an image batch goes to the worker where most of its members are already resident;
3. the other batches take workers that are free now (not inside a step, `RoundInput.busy`),
   most urgent batch first: an image's whole SLO can be shorter than one video step, so it must
   not wait for a busy worker's boundary while a free worker idles; empty workers before those
   holding residents no batch of theirs keeps (`occupied`), which the batch would displace;
4. videos that grow or start take the unclaimed workers, free ones first, each in worker order
   (contiguous where they can, as SP groups prefer): a group starts when all its members are
   free, so a busy member delays one step of a video, not a whole image;
5. the remaining batches take what is left, in worker order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stepserve.policies.genserve.candidates import VideoOptions
from stepserve.policies.genserve.image_batching import PlannedBatch


@dataclass(frozen=True)
class Placement:
    video_workers: tuple[tuple[str, ...], ...]  # per video (in the order given); () when not running
    batch_workers: tuple[tuple[int, str], ...]  # (index into the batches, worker), in batch order


def materialize(workers: Sequence[str], options: Sequence[VideoOptions], degrees: Sequence[int],
                batches: Sequence[PlannedBatch], placed: Sequence[int],
                busy: Collection[str] = frozenset(), occupied: Collection[str] = frozenset()) -> Placement:
    if sum(degrees) + len(placed) > len(workers):
        raise ValueError(f"plan needs {sum(degrees) + len(placed)} workers, the round has {len(workers)}")
    position: dict[str, int] = {}

    def rank(worker: str) -> int:  # the worker's place in `workers`, the order ties go by
        if not position:  # built on first need: most rounds place every batch without it
            position.update((w, i) for i, w in enumerate(workers))
        return position[worker]

    claimed: set[str] = set()
    groups: list[list[str]] = [[] for _ in options]

    for j, option in enumerate(options):
        job = option.job
        if job.running and degrees[j] > 0:
            groups[j] = list(job.workers[: min(degrees[j], job.degree)])
            claimed.update(groups[j])

    batch_worker: dict[int, str] = {}
    for k in placed:
        counts: dict[str, int] = {}
        for member in batches[k].members:
            if member.worker_id is not None and member.worker_id not in claimed:
                counts[member.worker_id] = counts.get(member.worker_id, 0) + 1
        if counts:
            home = next(iter(counts)) if len(counts) == 1 else min(counts, key=lambda w: (-counts[w], rank(w)))
            batch_worker[k] = home
            claimed.add(home)

    homeless = [k for k in placed if k not in batch_worker]  # `placed` is in priority order
    if homeless:
        # Free workers, empty ones first; the walk over the pool stops once the empty ones
        # found can take every homeless batch (a round on 512 workers places a few).
        empty, held = [], []
        for w in workers:
            if w not in claimed and w not in busy:
                (held if w in occupied else empty).append(w)
                if len(empty) >= len(homeless):
                    break
        for k, w in zip(homeless, empty + held):
            batch_worker[k] = w
            claimed.add(w)

    needs = [degrees[j] - len(groups[j]) for j in range(len(options))]
    unplaced = len(placed) - len(batch_worker)
    if unplaced or any(n > 0 for n in needs):
        pool = [w for w in workers if w not in claimed and w not in busy] + \
            [w for w in workers if w not in claimed and w in busy]
        taken = 0
        for j, need in enumerate(needs):
            if need > 0:
                groups[j].extend(pool[taken: taken + need])
                taken += need
        rest = sorted(pool[taken:], key=rank)
        for k in placed:
            if k not in batch_worker:
                batch_worker[k] = rest.pop(0)

    return Placement(
        video_workers=tuple(tuple(g) for g in groups),
        batch_workers=tuple((k, batch_worker[k]) for k in sorted(placed)),
    )
