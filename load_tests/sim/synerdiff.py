"""SynerDiff's worker-level mechanisms in the simulator: images decode on the denoiser's own GPU,
beside its denoising rounds (the setting SynerDiff studies), priced by the concurrent-latency
model of `policies.synerdiff.contention` (derived from the paper; no GPU here measures one).

Each switch is one of the paper's components, for the ablation:
- `chunking` (§III-B): a decode runs as c chunks, one a round, c chosen offline by L(c)
  (Eq. 1-2, `choose_chunks` on the model's profiled timings); off: whole decodes beside a
  round, InstGenIE's direct UNet-VAE concurrency.
- `skip_cfg` (§III-B, Fig. 9): a request past s_min for the quality threshold S (the measured
  curve, `skip_cfg_curve`) may run its step without its unconditional row.
- `planner` (§III-D, Eq. 3, Alg. 1): each round's M stepping tasks, N decode chunks and K
  eligible skips split into the sequence of sub-rounds `plan_sequence` picks under the
  throughput slack alpha; off: one coarse round, every eligible task skipping.
- `controller` (§III-D): the queue's trend lowers S (more skip-CFG), then raises c; restores both
  as it falls; off: S and c stay.

The planner plans with the table of the round's most common model and size (one table a
(model, size, c)); each sub-round is then priced on what it really holds: its members' forwards by
the cost model, its chunks' decodes, their contention. A worker with decodes left and no plan runs
them alone (`drain`). A plan cut short has already counted its decodes' rounds (plans the
continuous policy makes are rarely cut).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.synerdiff import (
    ChunkTiming,
    ConcurrencyTable,
    ControllerConfig,
    SkipCfgCurve,
    assign,
    choose_chunks,
    max_chunks,
    observe,
    plan_sequence,
    start,
)
from stepserve.policies.synerdiff import chunks as controller_chunks
from stepserve.policies.synerdiff import quality as controller_quality
from stepserve.policies.synerdiff.contention import Contention, concurrency_table
from stepserve.policies.types import RequestSpec
from stepserve.runtime import default_config_path, load_serve_config


@functools.cache
def served_curve(model: str = "shapes") -> tuple[tuple[float, float], ...]:
    """The skip-CFG curve the embedded default serves `model` with (SSIM against exact when every
    request skips from each fraction of its steps on: `load_tests.bench_skip_cfg`, measured on the
    trained shapes model; the one curve measured here)."""
    config = load_serve_config(default_config_path())["applications"][0]["args"]
    curve = next(m.get("skip_cfg_curve") for m in config["models"] if m["name"] == model)
    if not curve:
        raise ValueError(f"model {model!r} of {default_config_path()} has no skip_cfg_curve")
    return tuple((float(f), float(ssim)) for f, ssim in curve)


@dataclass(frozen=True)
class SynerDiffSim:
    chunking: bool = True
    skip_cfg: bool = True
    planner: bool = True
    controller: bool = True
    # S, best first; the first without a controller. The floor is the paper's fidelity budget under
    # the burst (Table II: DINO 13% below vanilla): SSIM 0.87, which on the shapes curve skips CFG
    # from the first step.
    quality_levels: tuple[float, ...] = (0.95, 0.93, 0.91, 0.89, 0.87)
    curve: tuple[tuple[float, float], ...] = field(default_factory=served_curve)
    alpha: float = 0.1  # §IV-A1
    lam: float = 0.5  # L(c)'s weight, §IV-A1
    most_chunks: int = 8  # the chunkings the offline profiler tries
    window: int = 4  # the controller's queue observations
    contention: Contention = field(default_factory=Contention)

    def describe(self) -> dict[str, Any]:
        return {"chunking": self.chunking, "skip_cfg": self.skip_cfg, "planner": self.planner,
                "controller": self.controller, "quality_levels": list(self.quality_levels),
                "skip_cfg_curve": [list(point) for point in self.curve], "alpha": self.alpha,
                "lam": self.lam, "contention": {"whole": self.contention.whole, "floor": self.contention.floor}}


class _Decode:
    __slots__ = ("rid", "spec", "left", "chunks")

    def __init__(self, rid: str, spec: RequestSpec, chunks: int) -> None:
        self.rid, self.spec, self.left, self.chunks = rid, spec, chunks, chunks


class WorkerSequencer:
    """One simulated worker's decode lane and round sequencer."""

    def __init__(self, settings: SynerDiffSim, cost: Any, max_batch: int,
                 queue_length: Callable[[], int]) -> None:
        self.settings = settings
        self.cost = cost
        self.max_batch = max_batch
        self.queue_length = queue_length
        self.decodes: list[_Decode] = []
        self._tables: dict[tuple[str, int, int, int], ConcurrencyTable] = {}
        self._plans: dict[tuple, Any] = {}
        self._curve = SkipCfgCurve(settings.curve)
        self.skipped_steps = 0
        self.steps = 0
        self._levels: dict[tuple[str, int, int], tuple[int, ...]] = {}
        # The controller's chunk levels count steps above each size's offline c (1: c itself).
        self._control = ControllerConfig(settings.quality_levels, tuple(range(1, settings.most_chunks + 1)),
                                         window=settings.window)
        self._state = start(self._control)

    # -- the offline profiler (§III-C), on the derived model -----------------------------------

    def chunk_levels(self, model: str, height: int, width: int) -> tuple[int, ...]:
        """c chosen by L(c), then each finer c up to C_max (the controller's steps); (1,) without chunking."""
        key = (model, height, width)
        if key not in self._levels:
            if not self.settings.chunking:
                self._levels[key] = (1,)
            else:
                batch = max(1, self.max_batch // 2)
                unet = self._unet_seconds(model, height, width, batch, 0)
                decode = self.cost.decode_seconds(model, height, width)
                timings = []
                for c in range(1, self.settings.most_chunks + 1):
                    tau, delta = self.settings.contention.round(unet, decode / c, c)
                    timings.append(ChunkTiming(c, (tau,) * c, (tau,) * (c - 1) + (delta,)))
                best = choose_chunks(timings, unet, decode, self.settings.lam)
                ceiling = max(best, max_chunks(timings, unet))
                self._levels[key] = tuple(range(best, ceiling + 1))
        return self._levels[key]

    def _unet_seconds(self, model: str, height: int, width: int, m: int, k: int) -> float:
        return self.cost.round_seconds([BatchShape(model, height, width, rows=2 * m - k)])

    def _table(self, model: str, height: int, width: int, chunks: int) -> ConcurrencyTable:
        key = (model, height, width, chunks)
        if key not in self._tables:
            self._tables[key] = concurrency_table(
                lambda m, k: self._unet_seconds(model, height, width, m, k),
                self.cost.decode_seconds(model, height, width), chunks, self.max_batch, self.max_batch,
                self.settings.contention)
        return self._tables[key]

    # -- online ------------------------------------------------------------------------------

    @property
    def quality(self) -> float:
        return controller_quality(self._control, self._state)

    def observe_queue(self) -> None:
        """The controller's step at a plan's start (§III-D: queue buildup lowers S, then raises c)."""
        if self.settings.controller:
            self._state = observe(self._control, self._state, self.queue_length())

    def enqueue(self, rid: str, spec: RequestSpec) -> None:
        """A finished image's decode joins the lane, at the chunking of now."""
        levels = self.chunk_levels(spec.model, spec.height, spec.width)
        step = controller_chunks(self._control, self._state) - 1
        self.decodes.append(_Decode(rid, spec, levels[min(step, len(levels) - 1)]))

    def rounds(self, members: Sequence[Any], steps: int) -> tuple[list[float], list[tuple[str, float]]]:
        """The seconds of each of a plan's `steps` rounds for its stepping `members` (with `spec`
        and `done`), and the decodes that end in them (request id, seconds from the first round's
        start)."""
        times: list[float] = []
        ended: list[tuple[str, float]] = []
        done = {id(m): m.done for m in members}
        elapsed = 0.0
        for _ in range(steps):
            seconds, finished = self._round(members, done)
            ended += [(rid, elapsed + offset) for rid, offset in finished]
            elapsed += seconds
            times.append(seconds)
            for m in members:
                done[id(m)] += 1
        return times, ended

    def drain(self) -> list[tuple[str, float]]:
        """A worker with nothing to step runs its decodes' chunks alone, oldest first."""
        elapsed, ended = 0.0, []
        for decode in self.decodes:
            spec = decode.spec
            elapsed += self.cost.decode_seconds(spec.model, spec.height, spec.width) * decode.left / decode.chunks
            ended.append((decode.rid, elapsed))
        self.decodes = []
        return ended

    def _round(self, members: Sequence[Any], done: dict[int, int]) -> tuple[float, list[tuple[str, float]]]:
        quality = self.quality
        eligible = [m for m in members if self.settings.skip_cfg and m.spec.uses_cfg
                    and self._curve.eligible(done[id(m)], m.spec.steps_to_run, quality)]
        decodes = list(self.decodes)
        if self.settings.planner and members:
            stages = self._planned(members, eligible, decodes)
        else:
            stages = [(list(members), eligible, decodes)]
        elapsed, finished = 0.0, []
        for stepping, skipping, decoding in stages:
            tau, delta = self._price(stepping, skipping, decoding)
            for decode in decoding:
                decode.left -= 1
                if decode.left == 0:
                    finished.append((decode.rid, elapsed + delta))
            elapsed += tau
        self.decodes = [d for d in self.decodes if d.left > 0]
        self.steps += len(members)
        self.skipped_steps += sum(len(s) for _, s, _ in stages)
        return elapsed, finished

    def _planned(self, members, eligible, decodes) -> list[tuple[list, list, list]]:
        sizes = Counter((m.spec.model, m.spec.height, m.spec.width) for m in members)
        model, height, width = sizes.most_common(1)[0][0]
        chunks = decodes[0].chunks if decodes else self.chunk_levels(model, height, width)[0]
        m, n, k = len(members), min(len(decodes), len(members)), len(eligible)
        key = (model, height, width, chunks, m, n, k)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_sequence(m, n, k, self._table(model, height, width, chunks),
                                                    self.settings.alpha)
        ids = {id(x): x for x in list(members) + decodes}
        mapping = assign(plan, [str(id(x)) for x in members], [str(id(x)) for x in eligible],
                         [str(id(x)) for x in decodes[:n]])
        stages = [([ids[int(i)] for i in u], [ids[int(i)] for i in s], [ids[int(i)] for i in v]) for u, s, v in mapping]
        if len(decodes) > n:  # more decodes than tasks (Eq. 3d): the rest run in the last sub-round
            stages[-1][2].extend(decodes[n:])
        return stages

    def _price(self, stepping, skipping, decoding) -> tuple[float, float]:
        """A sub-round's (tau, delta): its forwards by the cost model, grouped by shape as the
        worker groups them, beside its decode chunks."""
        skip = {id(m) for m in skipping}
        rows: Counter = Counter()
        for member in stepping:
            spec = member.spec
            rows[(spec.model, spec.height, spec.width)] += spec.rows - (1 if id(member) in skip else 0)
        unet = self.cost.round_seconds([BatchShape(model, h, w, rows=r) for (model, h, w), r in rows.items()]) \
            if rows else 0.0
        vae = sum(self.cost.decode_seconds(d.spec.model, d.spec.height, d.spec.width) / d.chunks for d in decoding)
        chunks = min((d.chunks for d in decoding), default=1)
        if unet == 0.0:
            return vae, vae
        tau, delta = self.settings.contention.round(unet, vae, chunks)
        return tau, delta
