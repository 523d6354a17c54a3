"""First-Block Cache (FBCache, as in diffusers' `FirstBlockCacheConfig` and ParaAttention), one
decision per request per step, inside one batched forward.

Every row runs the model's first block. A request whose first-block output moved, since its last
computed step, by less than its threshold (mean absolute change over mean absolute value) skips
the later blocks: its rows leave the batch, which runs those blocks only for the rows that
compute (a smaller batch, not a masked one), and it takes what the later blocks gave it at its
last computed step. On a DiT that is their residual (last hidden state minus first), added to this
step's first-block output before the output layer; on a UNet, whose skip connections leave no
single residual stream, it is the whole noise prediction. A request's first step, and any step
after one it did not run here (`reset`), computes in full; a threshold of 0 never skips, and its
forward is the model's own.

With `order` 1 a skipping request does not take that result as it was but extrapolates it, to
first order, from its last two computed steps (TaylorSeer, Liu et al. 2025, as cache-dit uses it
to calibrate its block cache): result(k) = result(k1) + (k - k1) (result(k1) - result(k0)) / (k1 - k0).

The state is the request's own, never its batch's (requests join and leave batches at every
step), and is not exported: a request resumed elsewhere computes its next step in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FirstBlockCache:
    """One request's cache: its threshold, rows and order (0: reuse; 1: TaylorSeer), its first
    block's output at its last computed step and what the later blocks gave it then (and at the
    computed step before, for `order` 1), and how many of its steps computed or skipped here."""

    threshold: float
    rows: int
    order: int = 0
    first: torch.Tensor | None = None
    cached: torch.Tensor | None = None
    cached_at: int = 0  # the step (counted here) `cached` is of
    before: torch.Tensor | None = None  # `order` 1: the computed step's before that
    before_at: int = 0
    computed: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"a step-cache threshold is >= 0, got {self.threshold}")
        if self.order not in (0, 1):
            raise ValueError(f"a step cache reuses (order 0) or extrapolates to first order (1), got {self.order}")

    @property
    def may_skip(self) -> bool:
        return self.first is not None and self.threshold > 0

    def change(self, first: torch.Tensor) -> torch.Tensor:
        """How far its first block's output (now `first`, its rows) moved since its last computed
        step: mean absolute change over mean absolute value (a 0-d tensor, on the device)."""
        return (first - self.first).abs().mean() / self.first.abs().mean().clamp_min(1e-12)

    def reset(self) -> None:
        """A step ran elsewhere: what is cached is a step behind, so its next step computes."""
        self.first = self.cached = self.before = None

    def reused(self) -> torch.Tensor:
        """What a skipped step takes: the cached result, or its first-order extrapolation."""
        if self.order == 0 or self.before is None:
            return self.cached
        step = self.computed + self.skipped
        slope = (self.cached - self.before) / (self.cached_at - self.before_at)
        return self.cached + (step - self.cached_at) * slope

    def drop_unconditional(self) -> None:
        """From now on its request runs its conditional row alone (skip-CFG): keep that row, the
        last, of what is cached, so its change is measured on it and a skipped step reuses it."""
        if self.rows != 2:
            raise ValueError(f"only a CFG request's two rows drop to one, this cache has {self.rows}")
        self.rows = 1
        self.first, self.cached, self.before = (None if t is None else t[1:] for t in (self.first, self.cached,
                                                                                       self.before))

    def keep(self, first: torch.Tensor, result: torch.Tensor) -> None:
        """A computed step's first-block output and later-blocks result (copies: the batch's
        tensors must not stay alive with the request)."""
        if self.order:
            self.before, self.before_at = self.cached, self.cached_at
        self.first, self.cached = first.clone(), result.clone()
        self.cached_at = self.computed + self.skipped


@dataclass(frozen=True)
class SplitForward:
    """A model's forward cut after its first block: `head` runs it for every row and returns the
    first block's output and what the rest needs (batch-first tensors, nested in tuples); `body`
    runs the later blocks for some rows' share of that; `foot` makes the output from the last
    hidden state (and the whole batch's carry). `residual`: a skipping row reuses the later
    blocks' residual (DiT) rather than their output (UNet: `foot` is then the identity)."""

    head: Callable[[], tuple[torch.Tensor, Any]]
    body: Callable[[Any], torch.Tensor]
    foot: Callable[[torch.Tensor, Any], torch.Tensor]
    residual: bool


def first_block_cached(split: SplitForward, caches: Sequence[FirstBlockCache]) -> torch.Tensor:
    """The batch's output; `caches`: its requests', in row order (each request's `rows` rows)."""
    first, carry = split.head()
    bounds = _bounds([cache.rows for cache in caches])
    skips = _skips(first, caches, bounds)
    compute = [row for (a, b), skip in zip(bounds, skips) if not skip for row in range(a, b)]
    done = None
    if compute:
        everyone = len(compute) == first.shape[0]
        done = split.body(carry if everyone else take(carry, torch.tensor(compute, device=first.device)))
    later, at = [], 0  # each request's last hidden state (DiT) or output (UNet)
    for cache, (a, b), skip in zip(caches, bounds, skips):
        if skip:
            reused = cache.reused()
            cache.skipped += 1
            later.append(first[a:b] + reused if split.residual else reused)
            continue
        mine = done[at:at + b - a]
        at += b - a
        if cache.threshold:  # (one that never skips keeps nothing)
            cache.keep(first[a:b], mine - first[a:b] if split.residual else mine)
        cache.computed += 1
        later.append(mine)
    joined = later[0] if len(later) == 1 else torch.cat(later)
    return split.foot(joined, carry) if split.residual else joined


def _skips(first: torch.Tensor, caches: Sequence[FirstBlockCache], bounds: list[tuple[int, int]]) -> list[bool]:
    """Which requests skip: their changes measured on the device and read back at once (one
    device sync a forward, not one a request)."""
    asking = [i for i, cache in enumerate(caches) if cache.may_skip]
    skips = [False] * len(caches)
    if asking:
        changes = torch.stack([caches[i].change(first[slice(*bounds[i])]) for i in asking]).tolist()
        for i, change in zip(asking, changes):
            skips[i] = change < caches[i].threshold
    return skips


def take(carry: Any, index: torch.Tensor) -> Any:
    """The rows `index` of every tensor in `carry` (a tensor, or tuples of them nested)."""
    if isinstance(carry, tuple):
        return tuple(take(item, index) for item in carry)
    return carry.index_select(0, index)


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for size in sizes:
        out.append((at, at + size))
        at += size
    return out
