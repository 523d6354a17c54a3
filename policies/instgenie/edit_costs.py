"""What a forward with cached activations costs (InstGenIE §3.2 Table 1, §4.4 Fig. 11).

An edit of a template computes only its masked tokens and reuses the cached activations of the
rest, so its work and the bytes it loads both scale linearly with its mask ratio m. Per
transformer block and batch row, with L image tokens, T text tokens and hidden size H (FLOPs,
two per multiply-add; Table 1 and Fig. 5-bottom):

    Q and output projections       4 m L H^2        (masked tokens only)
    K and V projections            4 L H^2          (every token: the masked ones attend to all)
    feed-forward (ratio r)         4 r m L H^2
    attention QK^T and AV          4 m L (L + T) H
    text tokens                    computed in full, and attended to (the same terms at m = 1)
    cached activations to load     (1 - m) L H values (the block's output Y of unmasked tokens)

Where the cache holds each block's keys and values instead of its outputs (Fig. 7's alternative,
`DiTDims.keys_values`), an unmasked token computes nothing, K and V included (4 m L H^2), and
loads its keys and values: 2 (1 - m) L H values.

A row without a cache (any request but an edit of a template) is the same at m = 1 with nothing
to load, so a batch is described by its rows and its row-weighted mean ratio
(`BatchShape.mask_ratio`). The paper maps a batch's FLOPs to latency with a line fitted by least
squares on profiled points (R^2 0.998-0.999 for SDXL and Flux on an H800, Fig. 11), and its
loading by a second line (bytes to seconds); `EditCostModel` holds both and spreads a forward
over its blocks, so Algorithm 1 (pipeline_dp.py) can decide which blocks load. Model dimensions
come from the caller as `DiTDims` (one per stage of equal blocks: one for a DiT such as Flux,
two for SDXL's UNet), never from a table here.

`MaskAwareCosts` is a `CostModel` that prices forwards with cached activations this way and
everything else as its base model does: what the simulator and the mask-aware placement ask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from stepserve.policies.cost_model import BatchShape, CostModel
from stepserve.policies.instgenie.pipeline_dp import Loading, Pipeline, plan
from stepserve.policies.wrapped_costs import WrappedCosts


@dataclass(frozen=True)
class DiTDims:
    """One stage of `blocks` equal transformer blocks. A token covers `patch` x `patch` latent
    pixels, a latent pixel `latent_factor` x `latent_factor` image pixels (the VAE's factor).
    Flux at 1024 px: 57 blocks, hidden 3072, patch 2, 512 text tokens (4096 image tokens).
    `keys_values`: the cache holds each block's keys and values, not its outputs (Fig. 7)."""

    blocks: int
    hidden: int
    patch: int = 2
    text_tokens: int = 0
    latent_factor: int = 8
    mlp_ratio: float = 4.0
    bytes_per_value: int = 2  # of the cached activations (fp16/bf16)
    keys_values: bool = False

    def __post_init__(self) -> None:
        for name in ("blocks", "hidden", "patch", "latent_factor", "bytes_per_value"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DiTDims.{name} must be a positive int, got {value!r}")
        if isinstance(self.text_tokens, bool) or not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise ValueError(f"DiTDims.text_tokens must be an int >= 0, got {self.text_tokens!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"DiTDims.mlp_ratio must be > 0, got {self.mlp_ratio!r}")

    def tokens(self, height: int, width: int) -> int:
        """Image tokens of one row at this size."""
        side = self.latent_factor * self.patch
        return (height // side) * (width // side)

    def block_flops(self, tokens: int, rows: int, mask_ratio: float) -> float:
        """One block's FLOPs over `rows` rows whose mean share of computed tokens is `mask_ratio`."""
        h, keys = self.hidden, tokens + self.text_tokens
        computed = (4 + 4 * self.mlp_ratio) * h * h + 4 * keys * h  # a token computed: Q, O, FFN, attention
        kv = 4 * h * h  # K and V: of every token, unless the cache holds them
        image = mask_ratio * (computed + kv) if self.keys_values else mask_ratio * computed + kv
        return rows * (tokens * image + self.text_tokens * (computed + kv))

    def block_bytes(self, tokens: int, rows: int, mask_ratio: float) -> float:
        """Bytes of one block's cached activations the batch loads."""
        values = 2 if self.keys_values else 1  # keys and values, or outputs
        return rows * (1.0 - mask_ratio) * tokens * values * self.hidden * self.bytes_per_value


def forward_flops(dims: Sequence[DiTDims], height: int, width: int, rows: int, mask_ratio: float = 1.0) -> float:
    """A forward's FLOPs over every stage's blocks (Table 1)."""
    return sum(d.blocks * d.block_flops(d.tokens(height, width), rows, mask_ratio) for d in dims)


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x, with the fit's R^2 over its `points` (None: not fitted)."""

    intercept: float
    slope: float
    r2: float | None = None
    points: int = 0

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    @classmethod
    def bandwidth(cls, bytes_per_s: float, fixed_s: float = 0.0) -> "LinearFit":
        """Loading as `fixed_s` + bytes / `bytes_per_s` (a copy's launch plus its transfer)."""
        if not bytes_per_s > 0 or not fixed_s >= 0:
            raise ValueError(f"need bytes_per_s > 0 and fixed_s >= 0, got {bytes_per_s}, {fixed_s}")
        return cls(fixed_s, 1.0 / bytes_per_s)


def fit_line(points: Sequence[tuple[float, float]]) -> LinearFit:
    """Least squares through (x, y) points, with R^2 (1.0 when y does not vary and is hit)."""
    if len({x for x, _ in points}) < 2:
        raise ValueError(f"a line needs points at two x values at least, got {len(points)} point(s)")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in points)
    total = sum((y - my) ** 2 for _, y in points)
    return LinearFit(intercept, slope, 1.0 - residual / total if total > 0 else float(residual == 0), n)


@dataclass(frozen=True)
class BlockCosts:
    """Algorithm 1's inputs for one batch: per block, compute with cached activations (at the
    batch's mask ratio), compute without (every token), and loading its cached activations."""

    with_cache: tuple[float, ...]
    without_cache: tuple[float, ...]
    load: tuple[float, ...]


@dataclass(frozen=True)
class EditCostModel:
    """One model's forwards with cached activations on one device.

    `compute`: a whole forward's FLOPs to seconds (the fitted line; its intercept, the part that
    does not shrink with the work, is shared evenly by the blocks). `load`: one block's bytes to
    seconds. `loading`: how the forward overlaps the two (Algorithm 1 by default, as InstGenIE).
    """

    dims: tuple[DiTDims, ...]
    compute: LinearFit
    load: LinearFit
    loading: Loading = Loading.ALGORITHM1

    def __post_init__(self) -> None:
        if not self.dims:
            raise ValueError("EditCostModel needs the dimensions of one stage of blocks at least")
        object.__setattr__(self, "loading", Loading(self.loading))

    @property
    def blocks(self) -> int:
        return sum(d.blocks for d in self.dims)

    def flops(self, height: int, width: int, rows: int, mask_ratio: float = 1.0) -> float:
        return forward_flops(self.dims, height, width, rows, mask_ratio)

    def block_costs(self, height: int, width: int, rows: int, mask_ratio: float) -> BlockCosts:
        shared = self.compute.intercept / self.blocks
        slope = self.compute.slope
        cw: list[float] = []
        cwo: list[float] = []
        lm: list[float] = []
        for d in self.dims:
            tokens = d.tokens(height, width)
            cw += [shared + slope * d.block_flops(tokens, rows, mask_ratio)] * d.blocks
            cwo += [shared + slope * d.block_flops(tokens, rows, 1.0)] * d.blocks
            nbytes = d.block_bytes(tokens, rows, mask_ratio)
            lm += [self.load(nbytes) if nbytes > 0 else 0.0] * d.blocks
        return BlockCosts(tuple(cw), tuple(cwo), tuple(lm))

    def pipeline(self, height: int, width: int, rows: int, mask_ratio: float,
                 loading: Loading | None = None) -> Pipeline:
        """The forward as `loading` (default: this model's) runs it."""
        costs = self.block_costs(height, width, rows, mask_ratio)
        return plan(loading or self.loading, self.blocks, costs.with_cache, costs.without_cache, costs.load)

    def seconds(self, height: int, width: int, rows: int, mask_ratio: float = 1.0,
                loading: Loading | None = None) -> float:
        """One forward's seconds; at mask ratio 1 (nothing cached) every block computes in full."""
        if mask_ratio >= 1.0:
            return self.compute(self.flops(height, width, rows))
        return self.pipeline(height, width, rows, mask_ratio, loading).latency

    @classmethod
    def fitted(cls, dims: Sequence[DiTDims], samples: Sequence[tuple[BatchShape, float]], load: LinearFit,
               loading: Loading = Loading.ALGORITHM1) -> "EditCostModel":
        """The compute line fitted to profiled forwards (batch, seconds): each at its FLOPs."""
        points = [(forward_flops(dims, b.height, b.width, b.rows, b.mask_ratio), s) for b, s in samples]
        return cls(tuple(dims), fit_line(points), load, loading)


class MaskAwareCosts(WrappedCosts):
    """A `CostModel` whose forwards with cached activations cost what the model's
    `EditCostModel` says; everything else, add-ons included, is its `base` model's. A model with
    no `EditCostModel` has no mask-aware engine: its edits compute in full, as does a batch split
    over workers (sequence or CFG parallel: the worker runs the plain forward there) or a video.

    Answers are remembered per batch shape (the simulator and the placement ask the same ones
    many times); owned by its caller, like every cost memo.
    """

    def __init__(self, base: CostModel, edits: Mapping[str, EditCostModel]) -> None:
        super().__init__(base)
        self.edits = dict(edits)
        self._saved: dict[BatchShape, float] = {}

    def saving_seconds(self, batch: BatchShape) -> float:
        """How much shorter the forward is than the base model's full forward of the same batch
        (0 when nothing is cached)."""
        edit = self.edits.get(batch.model)
        if edit is None or not batch.uses_cache or batch.sp_degree != 1 or batch.cfg_split or batch.frames != 1:
            return 0.0
        saved = self._saved.get(batch)
        if saved is None:
            full = self.base.denoise_seconds(replace(batch, controlnet_rows=(), lora_rows=0, mask_ratio=1.0))
            saved = full - edit.seconds(batch.height, batch.width, batch.rows, batch.mask_ratio)
            if len(self._saved) >= 1 << 16:  # bounded: the ratios are floats, a long run meets many
                self._saved.clear()
            self._saved[batch] = saved
        return saved

    # -- CostModel ---------------------------------------------------------------------------

    def denoise_seconds(self, batch: BatchShape) -> float:
        return self.base.denoise_seconds(batch) - self.saving_seconds(batch)

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        return self.base.round_seconds(batches) - sum(self.saving_seconds(b) for b in batches)

    def step_seconds(self, batch: BatchShape) -> float:
        seconds = self.base.step_seconds(batch)
        return seconds if math.isinf(seconds) else seconds - self.saving_seconds(batch)
