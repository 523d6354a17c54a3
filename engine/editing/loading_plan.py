"""Which cache slots a masked forward loads and which blocks compute every token instead, decided on
the worker per forward (InstGenIE §4.2, Fig. 9-bottom, Algorithm 1).

The decision is `policies.instgenie.pipeline_dp`'s, over the block costs the profile measured for
this forward's model, size, rows and mask ratio (`policies.instgenie.block_profile`). A block that
computes every token is at least as exact as one that takes the unmasked tokens from the cache, so
the choice changes speed, never what is approximated beyond the cache itself. Without costs for the
shape, every slot loads (the strawman pipeline), and the forward is counted as planned without
them. A `KEYS_VALUES` record is loaded whole: its forward never computes the unmasked tokens, so
none of its blocks can compute them in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.policies.instgenie.block_profile import MeasuredBlockCosts
from stepserve.policies.instgenie.pipeline_dp import Loading, plan
from stepserve.policies.types import EditBlockCounts

# The ways a worker may serve (`edit_cache.loading`): the others of `Loading` are not ways to run a
# forward (`ideal` loads for free) or only the paper's strawman baseline (`naive`).
SERVED_LOADINGS = (Loading.ALWAYS_LOAD, Loading.ALGORITHM1, Loading.OPTIMAL)
MEMO_LIMIT = 4096  # distinct forward shapes remembered before the memo starts over


@dataclass(frozen=True)
class LoadingPlanner:
    """How a worker's masked forwards choose their slots: `loading` over `costs`."""

    loading: Loading = Loading.ALWAYS_LOAD
    costs: MeasuredBlockCosts | None = None
    # A group of edits runs the same shape for all its steps: its choice is made once (the exact
    # `optimal` search takes milliseconds for 24 blocks, a step's forward tens of them).
    _chosen: dict[tuple, tuple[tuple[bool, ...], bool]] = field(default_factory=dict, init=False, repr=False,
                                                                 compare=False)

    def __post_init__(self) -> None:
        if Loading(self.loading) not in SERVED_LOADINGS:
            raise ValueError(f"loading {Loading(self.loading).value!r} is not a way to serve; "
                             f"one of {[m.value for m in SERVED_LOADINGS]}")

    def use_cache(self, kind: CacheKind, slots: int, model: str, height: int, width: int, rows: int,
                  share: float) -> tuple[tuple[bool, ...], bool]:
        """Per slot, whether it uses its cache, for a forward of `rows` rows at `height` x `width`
        px computing `share` of its image tokens; and whether measured costs decided it."""
        if CacheKind(kind) is CacheKind.KEYS_VALUES or Loading(self.loading) is Loading.ALWAYS_LOAD:
            return (True,) * slots, True
        key = (slots, model, height, width, rows, share)
        chosen = self._chosen.get(key)
        if chosen is None:
            if len(self._chosen) >= MEMO_LIMIT:
                self._chosen.clear()
            chosen = self._chosen[key] = self._choose(slots, model, height, width, rows, share)
        return chosen

    def _choose(self, slots: int, model: str, height: int, width: int, rows: int,
                share: float) -> tuple[tuple[bool, ...], bool]:
        costs = None if self.costs is None else self.costs.at(model, height, width, rows, share)
        if costs is None or len(costs[0]) != slots:
            return (True,) * slots, False
        return plan(self.loading, slots, *costs).use_cache, True


@dataclass
class BlockTally:
    """What a worker's masked forwards did since it was last taken: blocks that used their cache,
    blocks computed in full, forwards planned without measured costs."""

    loaded: int = 0
    computed: int = 0
    unplanned: int = 0

    def count(self, use_cache: tuple[bool, ...], planned: bool) -> None:
        self.loaded += sum(use_cache)
        self.computed += len(use_cache) - sum(use_cache)
        self.unplanned += not planned

    def take(self) -> EditBlockCounts:
        """The counts so far, and zero again (one plan's worth goes into its report)."""
        counts = EditBlockCounts(self.loaded, self.computed, self.unplanned)
        self.loaded = self.computed = self.unplanned = 0
        return counts
