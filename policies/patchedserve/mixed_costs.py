"""What one forward of several resolutions costs, priced from a profile of one-resolution forwards.

PatchedServe (§4) runs requests of different resolutions in one denoiser forward: images are
cut into patches, the pixel-wise operators (linear layers, feed-forward, cross-attention,
norms) run once over all patches, and self-attention runs per resolution group. A stepserve
worker that packs resolutions (`workers.pack_resolutions`) runs its plan's plain groups of a
model so (`engine.step_runner.StepRunner._packed`: SD3's and Flux's tokens packed, SD1.5/SDXL's UNet
patched). Such a forward is priced by this model, built on the profile's one-resolution rows
(the roofline estimate):

- a forward costs a fixed part plus a part proportional to the work it does;
- a resolution group's work is counted in seconds at the device's full pace: its rows times
  the profile's marginal cost of one more row at that resolution (the slope between
  `probe_rows / 2` and `probe_rows` rows, where the device is full);
- one forward of several groups costs what the profile says a forward at the resolution of
  the group with the most work costs when it does all the groups' work: that group's rows plus
  the others' work in rows of its size (linear between whole rows);
- never less than the dearest group alone (more work never costs less), never more than the
  groups one after another (what the worker does today).

For a profile linear in rows with the same intercept at every resolution (SD3.5 on the RTX 6000
here) this is exactly one fixed overhead plus each group's variable part. For one with a floor
(SDXL on the H800: a forward costs about 35 ms however small) small groups fill the idle
device almost for free, and once it is full every row costs its share: the roofline that
profile was derived from.

Where `stepserve profile` measured this device's packed forwards (denoise rows with `groups`),
`packed_profile.py` fits how they relate to the estimate (`PackingFit`): a packed forward costs
a share of the estimate plus a share of the groups one after another, no less than the dearest
group alone. A GPU's measured forwards sit near the estimate; a CPU, with no idle device to
fill, near the groups in turn or above them (the patched UNet's stitching copies cost more than
they save there), and the fit prices that honestly rather than the estimate's promise.

Only forwards are packed. The round's overheads (its fixed cost, each group's sampler
bookkeeping) are the base model's, and so is every batch that is not a plain image forward
(videos, SP or CFG splits, add-ons, edits reusing cached activations).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from stepserve.policies.cost_model import BatchShape, CostModel
from stepserve.policies.wrapped_costs import WrappedCosts


def packable(batch: BatchShape) -> bool:
    """A plain image forward on one worker: the kind PatchedServe packs."""
    return (batch.frames == 1 and batch.sp_degree == 1 and not batch.cfg_split and not batch.controlnet_rows
            and batch.lora_rows == 0 and not batch.uses_cache)


@dataclass(frozen=True)
class PackingFit:
    """A model's measured packed forwards, in terms of what the profile's one-resolution rows
    say: `roofline` x the roofline estimate + `sequential` x the groups one after another (both
    coefficients >= 0; (1, 0) is the estimate itself)."""

    roofline: float
    sequential: float

    def __post_init__(self) -> None:
        if not (self.roofline >= 0 and self.sequential >= 0 and self.roofline + self.sequential > 0):
            raise ValueError(f"a packing fit has non-negative coefficients, not both 0: {self}")

    def seconds(self, estimate_s: float, sequential_s: float) -> float:
        return self.roofline * estimate_s + self.sequential * sequential_s


class PackedForwardCosts(WrappedCosts):
    """A `CostModel` whose worker round runs the plain image batches of each model of `packing`
    (None: every model) as one packed forward; everything else as `base` says. A model of `fits`
    has its packed forwards priced as measured (`PackingFit`), the others by the roofline
    estimate. Row paces are remembered per resolution (owned by the caller, like every cost memo)."""

    def __init__(self, base: CostModel, probe_rows: int = 16, packing: Collection[str] | None = None,
                 fits: Mapping[str, PackingFit] | None = None) -> None:
        if isinstance(probe_rows, bool) or not isinstance(probe_rows, int) or probe_rows < 2 or probe_rows % 2:
            raise ValueError(f"probe_rows must be an even int >= 2, got {probe_rows!r}")
        super().__init__(base)
        self.probe_rows = probe_rows
        self.packing = None if packing is None else frozenset(packing)
        self.fits = dict(fits or {})
        self._row_s: dict[tuple[str, int, int], float] = {}

    def packs(self, model: str) -> bool:
        """Whether a round's plain image batches of `model` run as one packed forward."""
        return self.packing is None or model in self.packing

    def row_seconds(self, model: str, height: int, width: int) -> float:
        """One more row's seconds in a full forward at this resolution (the work unit)."""
        key = (model, height, width)
        seconds = self._row_s.get(key)
        if seconds is None:
            half = self.probe_rows // 2
            full = self.base.denoise_seconds(BatchShape(model, height, width, self.probe_rows))
            slope = (full - self.base.denoise_seconds(BatchShape(model, height, width, half))) / half
            # A profile flat in rows has no marginal cost to read: its mean row cost stands in.
            seconds = self._row_s[key] = slope if slope > 0 else full / self.probe_rows
        return seconds

    def packed_forward_seconds(self, batches: Sequence[BatchShape]) -> float:
        """One forward of all `batches` (plain image batches of one model): as its model's fit
        says where it has one, else the roofline estimate."""
        if not batches:
            return 0.0
        alone = self._alone(batches)
        fit = self.fits.get(batches[0].model)
        estimate = self._estimate(batches, alone)
        return estimate if fit is None or len(batches) == 1 else max(max(alone), fit.seconds(estimate, sum(alone)))

    def estimate_seconds(self, batches: Sequence[BatchShape]) -> float:
        """The roofline estimate of one forward of all `batches` (plain image batches of one model)."""
        return self._estimate(batches, self._alone(batches)) if batches else 0.0

    def _alone(self, batches: Sequence[BatchShape]) -> list[float]:
        """Each batch's forward alone, once the batches are known to be one packed forward's."""
        if len({b.model for b in batches}) != 1 or not all(packable(b) for b in batches):
            raise ValueError(f"a packed forward holds plain image batches of one model, got {list(batches)}")
        return [self.base.denoise_seconds(b) for b in batches]

    def _estimate(self, batches: Sequence[BatchShape], alone: list[float]) -> float:
        if len(batches) == 1:
            return alone[0]
        work = [b.rows * self.row_seconds(b.model, b.height, b.width) for b in batches]
        ref = batches[max(range(len(batches)), key=work.__getitem__)]
        rows = max(float(ref.rows), sum(work) / self.row_seconds(ref.model, ref.height, ref.width))
        whole = int(rows)
        seconds = self.base.denoise_seconds(replace(ref, rows=whole))
        if rows > whole:
            above = self.base.denoise_seconds(replace(ref, rows=whole + 1))
            seconds += (rows - whole) * (above - seconds)
        return min(sum(alone), max(max(alone), seconds))

    # -- CostModel ---------------------------------------------------------------------------

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        """One packed forward per model for its plain image batches, the rest one by one, plus the
        base model's round overheads."""
        packs: dict[str, list[BatchShape]] = {}
        forwards = 0.0
        for b in batches:
            if packable(b) and self.packs(b.model):
                packs.setdefault(b.model, []).append(b)
            else:
                forwards += self.base.denoise_seconds(b)
        forwards += sum(self.packed_forward_seconds(p) for p in packs.values())
        overhead = self.base.round_seconds(batches) - sum(self.base.denoise_seconds(b) for b in batches)
        return forwards + overhead


def packed(costs: CostModel, packing: Collection[str] | None = None,
           fits: Mapping[str, PackingFit] | None = None) -> PackedForwardCosts:
    """`costs` pricing packed forwards (of the models of `packing`; None: every model; measured
    ones by `fits`): itself if it already does (packing twice would price the round overheads
    from already packed forwards)."""
    return costs if isinstance(costs, PackedForwardCosts) else PackedForwardCosts(costs, packing=packing, fits=fits)
