"""SynerDiff's threshold-aware sequencer on a worker (§III-D), for a worker whose images decode
in chunks beside its rounds (`engine.decode_lane`): each round, a group's M stepping requests,
the lane's N pending decodes and the K requests past their skip-CFG step are split into the
sub-rounds `policies.synerdiff.plan_sequence` picks on the concurrency table measured for the
group's model at its size (`stepserve profile-concurrency`, one table each; a group with none runs
as one round): a sub-round runs its members' forward beside its share of the
decodes' chunks, and the members the plan picks skip CFG in it. Which request goes where is the
plan's task mapping (`assign`): decodes oldest first, skippers among the eligible in admission
order.

With a load controller (`policies.synerdiff.controller`, §III-D's feedback controller), each
plan starts with a sample of the router's queue (`WorkerPlan.queued`): as it builds, the
controller moves the skip-CFG start of every request that skips CFG one notch toward its floor
(`RequestSpec.skip_cfg_floor_from`: its model's quality floor), and once at the floor raises the
chunks of each decode that starts (`chunks`); as it falls, it undoes both in reverse. Requests
whose quality threshold is 1 are never touched.

It composes with the router's pool-level decision: the router still chooses what each worker
steps; the sequencer only orders a group's step into sub-rounds and says how many decodes ride
along, so every request still takes exactly one step a round. Splitting a group changes only
batch composition (each request's rows are its own), and skip-CFG is the approximation its
curve and threshold allow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stepserve.engine.forward_modes.skip_cfg import follow_load, past_first_step
from stepserve.engine.sampler import Sampler
from stepserve.policies.synerdiff import ConcurrencyTable, ControllerConfig, assign, observe, plan_sequence, start
from stepserve.policies.synerdiff import chunks as controller_chunks
from stepserve.policies.synerdiff import quality as controller_quality
from stepserve.policies.types import RequestSpec, StepGroup

# The load controller's quality ladder: the share of each request's way from its own skip-CFG
# start to its floor's that is still unused (1: its own start; 0: its floor), one notch a trend.
LOAD_NOTCHES = (1.0, 2 / 3, 1 / 3, 0.0)


def load_controller(chunks: int, max_chunks: int, window: int) -> ControllerConfig:
    """The controller of a worker whose decodes run in `chunks` (up to `max_chunks` under load),
    following trends over `window` plans."""
    return ControllerConfig(LOAD_NOTCHES, tuple(range(chunks, max_chunks + 1)), window=window)


# What a concurrency table was measured for: a model at a size (model, height, width).
TableKey = tuple[str, int, int]
# A concurrency profile's columns (`stepserve profile-concurrency` writes them): its model and size,
# then Round(m = unet, n = vae, k = skip) at `chunks` and the round's (tau, delta).
PROFILE_COLUMNS = ("model", "height", "width", "chunks", "unet", "vae", "skip", "tau_s", "delta_s")


def table_key(spec: RequestSpec) -> TableKey:
    return spec.model, spec.height, spec.width


@dataclass(frozen=True)
class SequencerSpec:
    """A worker's sequencer, made once from the app config: its concurrency tables, one a model
    and size, its throughput slack alpha (Eq. 3f) and its load controller (`load_controller`;
    None: none)."""

    tables: Mapping[TableKey, ConcurrencyTable]
    alpha: float = 0.1
    controller: ControllerConfig | None = None


@dataclass(frozen=True)
class SubRound:
    """One sub-round: the members that step, those of them that skip CFG, and how many of the
    lane's decodes (oldest first) run a chunk beside it."""

    group: StepGroup
    skipping: frozenset[str]
    decodes: int


class RoundSequencer:
    def __init__(self, tables: Mapping[TableKey, ConcurrencyTable], alpha: float = 0.1,
                 controller: ControllerConfig | None = None):
        """`tables`: the measured concurrency table of each model at each size (a group of
        another model or size, or of several, runs as one round); `controller`: the load
        controller's ladders (`load_controller`; None: none)."""
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.tables = dict(tables)
        self.alpha = alpha
        self.controller = controller
        self._state = None if controller is None else start(controller)
        self._plans: dict[tuple[TableKey, int, int, int], tuple] = {}

    def observe(self, queued: int) -> None:
        """The load controller's step as a plan starts: `queued`, the router's queue then."""
        if self.controller is not None:
            self._state = observe(self.controller, self._state, queued)

    @property
    def load(self) -> float:
        """How far the controller has moved skip-CFG starts toward their floors (0: not at all, 1: there)."""
        return 0.0 if self.controller is None else 1.0 - controller_quality(self.controller, self._state)

    @property
    def chunks(self) -> int | None:
        """The chunks of a decode that starts now (None: the lane's own)."""
        return None if self.controller is None else controller_chunks(self.controller, self._state)

    @property
    def load_control(self) -> tuple[float, int] | None:
        """(`load`, `chunks`) as a plan reports them (`StepReport.load_control`); None without a controller."""
        return None if self.controller is None else (self.load, self.chunks)

    def sub_rounds(self, group: StepGroup, samplers: Mapping[str, Sampler], decodes: int) -> list[SubRound]:
        """The group's round as sub-rounds, planned on the table of its model at its size. A group
        over ranks, without a table (of several sizes included) or larger than its table's B_max
        runs as one round beside every decode; more decodes than members ride with the last."""
        members = [rid for rid in group.request_ids if rid in samplers]
        if self.controller is not None:
            for rid in members:
                follow_load(samplers[rid], self.load)
        keys = {table_key(samplers[rid].spec) for rid in members}
        key = keys.pop() if len(keys) == 1 else None
        table = self.tables.get(key)
        if group.ranks or table is None or len(members) > table.max_batch:
            return [SubRound(group, frozenset(), decodes)]
        eligible = [rid for rid in members if past_first_step(samplers[rid])]
        m, n, k = len(members), min(decodes, len(members)), len(eligible)
        if (key, m, n, k) not in self._plans:
            self._plans[key, m, n, k] = plan_sequence(m, n, k, table, self.alpha)
        plan = self._plans[key, m, n, k]
        decode_ids = [str(i) for i in range(n)]
        rounds = [SubRound(StepGroup(tuple(ids)), frozenset(skips), len(vae))
                  for ids, skips, vae in assign(plan, members, eligible, decode_ids)]
        if decodes > n:  # more decodes than members (Eq. 3d): the rest ride with the last sub-round
            last = rounds[-1]
            rounds[-1] = SubRound(last.group, last.skipping, last.decodes + decodes - n)
        return rounds

    @staticmethod
    def choose(sub: SubRound, samplers: Mapping[str, Sampler]) -> None:
        """Before a sub-round's forward: its members past their skip-CFG step skip as it says."""
        for rid in sub.group.request_ids:
            sampler = samplers.get(rid)
            if sampler is not None and past_first_step(sampler):
                sampler.mode_state.chosen = rid in sub.skipping
