"""Latency cost models: what a denoiser forward, a worker round, text encoding, decoding and a
whole request cost on one device, fitted from the profile CSVs `stepserve profile` writes.

Every denoiser latency is asked about a `BatchShape`, the one description of a batch that all
schedulers share: a new dimension of the work (mask ratio, LoRA set, patches) becomes a field
there and a column in the profile, not another cost protocol.

Pure Python, like every policy: the simulator and the live router ask the same model.

Profiles measure a grid; requests fall between grid points (PatchedServe: the combinations
explode), so each component is fitted by a few candidate methods and the one with the lowest
leave-one-out error over the grid wins (ties go to the simpler method, which extrapolates
better). Every fitted curve is non-decreasing in rows, pixels and texts by construction, so a
policy can rely on "more work never costs less".

CSV schema (one for every device), one row per measured point:

    model,device,component,height,width,rows,frames,latency_ms,samples,source,sp_degree,mask_ratio,groups,slot

- `component`: denoise | round_overhead | text_encode | vae_decode | request_overhead | host_probe |
  host_idle | router_cpu | controlnet | controlnet_transfer | denoise_encoder | lora | cfg_exchange |
  lora_load | block_cached | block_full | block_load
- `rows`: batch rows of one denoiser forward (2 per CFG request, 1 otherwise) for denoise and
  for the per-group part of round_overhead; the number of texts for text_encode; for
  host_probe, how many copies of one fixed forward ran at once on the host; 1 otherwise.
- host_probe rows say how busy cores slow each other on a CPU host (shared caches, memory
  bandwidth, hyperthread siblings of a VM's vCPUs): the same forward (height × width, one CFG
  request) timed alone (rows = 1) and with copies running beside it. `host_slowdown` is their
  ratio; a device with one worker per accelerator needs none.
- round_overhead rows with height = width = 0 are the fixed cost of one round (the RPC that
  carries the plan and the report); rows with a shape are the per-group sampler bookkeeping.
- host_idle and router_cpu say what else takes CPU on a host that runs the whole app (a CPU
  box), measured around `stepserve profile`'s live check: host_idle is the CPU milliseconds per
  wall second the idle app and everything else on the machine burn (Serve's controller, proxy
  and replicas, Ray's daemons, the OS), router_cpu the router process's CPU per denoising step
  (applying a report, deciding, sending the next plan: a decision per step where plans are one
  step, next to nothing inside a steady plan), which runs beside the worker's next step.
  Neither is a latency; both are optional (a GPU profile needs neither).
- lora_load rows (no shape, rows 1) price bringing one LoRA from the node's LoRA store into a
  worker's device memory; optional.
- cfg_exchange rows price latent parallelism (SwiftDiffusion §4.3): swapping the two workers'
  noise predictions of a CFG request split over them (`rows`: the request's rows, 2); optional.
- controlnet, controlnet_transfer, denoise_encoder and lora rows price add-ons (SwiftDiffusion):
  one ControlNet call's forward over `rows` rows; moving that call's residuals from the ControlNet
  service to the denoiser; the denoiser's forward up to its decoder blocks (what a ControlNet
  beside it overlaps); the extra time of unmerged LoRA updates over `rows` rows (a row with two
  LoRAs counts twice). All optional, as cfg_exchange: a profile without them prices that work at
  nothing extra and says so in its fit report (`missing_extras`); `addon_costs` combines them
  per placement.
- `frames`: 1 for images; a video's frame count (its work per row scales with pixels x frames).
- `sp_degree`: for denoise, how many workers ran the forward with sequence parallelism (Ulysses
  all-to-all); 1 otherwise. Each degree is fitted on its own, so communication's share (large
  for short sequences, GenServe Fig. 6) is in the numbers rather than modelled. A profile may
  omit the column (older files): every row is then degree 1.
- `mask_ratio`: for denoise, the share of image tokens the forward computed (InstGenIE): below 1,
  the served forward of edits with cached activations (the rest of the tokens taken from a
  template's record, loads included). `ProfiledCostModel` fits only full forwards (1) and keeps
  the others for `policies/instgenie/edit_profile.py`. Optional (older files): 1.
- `groups`: for denoise, empty for a forward of one resolution; else the resolution groups of one
  forward that ran them together (PatchedServe §4: a DiT's tokens packed, a UNet patched), as
  `rows@HEIGHTxWIDTH` joined by `+` (`2@64x64+4@128x128`). Such a row's height and width are its
  largest group's and its rows are all the groups' rows. `ProfiledCostModel` keeps these rows
  aside for `policies/patchedserve/packed_profile.py`; PatchedServe's Throughput Analyzer trains on
  them and the one-resolution rows (`policies/patchedserve/samples.py`). Optional (older files): empty.
- block_cached, block_full and block_load rows (with `slot`, the cache slot: a transformer block)
  price one slot of a masked forward with cached block outputs (InstGenIE §4.2, Algorithm 1's
  C_w, C_wo and L): computing its masked tokens with the rest from the cache (`mask_ratio`: the
  share of tokens computed), computing every token, and loading its cached activations to the
  device; per shape and rows. `ProfiledCostModel` keeps them aside (`block_rows`) for
  `policies/instgenie/block_profile.py`, which the worker's loading DP reads. Optional; `slot` is
  empty on every other row.
- `latency_ms`: the median of `samples` repeats; `source`: "measured <date> <device>" or a
  citation (derived tables say so).
"""

from __future__ import annotations

import csv
import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from stepserve.policies.addon_costs import ControlNetPlacement, forward_seconds
from stepserve.policies.step_cache_costs import cached_forward_share, expected_skip_share
from stepserve.policies.types import GroupSplit

if TYPE_CHECKING:
    from stepserve.policies.types import RequestSpec, RequestView, StepGroup

DENOISE = "denoise"
ROUND_OVERHEAD = "round_overhead"
TEXT_ENCODE = "text_encode"
VAE_DECODE = "vae_decode"
REQUEST_OVERHEAD = "request_overhead"
HOST_PROBE = "host_probe"
HOST_IDLE = "host_idle"
ROUTER_CPU = "router_cpu"
CONTROLNET = "controlnet"
CONTROLNET_TRANSFER = "controlnet_transfer"
DENOISE_ENCODER = "denoise_encoder"
LORA = "lora"
CFG_EXCHANGE = "cfg_exchange"
LORA_LOAD = "lora_load"
BLOCK_CACHED = "block_cached"
BLOCK_FULL = "block_full"
BLOCK_LOAD = "block_load"
# One cache slot of a masked forward with cached block outputs: Algorithm 1's C_w, C_wo and L.
BLOCK_COMPONENTS = (BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD)
# Optional prices of work beyond the plain forward: add-ons, and the exchange of a CFG split.
EXTRA_COMPONENTS = (CONTROLNET, CONTROLNET_TRANSFER, DENOISE_ENCODER, LORA, CFG_EXCHANGE)
COMPONENTS = (DENOISE, ROUND_OVERHEAD, TEXT_ENCODE, VAE_DECODE, REQUEST_OVERHEAD, HOST_PROBE, HOST_IDLE, ROUTER_CPU,
              *EXTRA_COMPONENTS, LORA_LOAD, *BLOCK_COMPONENTS)
HOST_COMPONENTS = (HOST_PROBE, HOST_IDLE, ROUTER_CPU)  # what the host does besides the model: optional
SHAPED = (DENOISE, VAE_DECODE, HOST_PROBE, *EXTRA_COMPONENTS, *BLOCK_COMPONENTS)  # rows that need a height and width

CSV_COLUMNS = ("model", "device", "component", "height", "width", "rows", "frames", "latency_ms", "samples", "source",
               "sp_degree", "mask_ratio", "groups", "slot")
# Absent in profiles written before video support (sp_degree), masked forwards (mask_ratio),
# packed forwards (groups) and per-block costs (slot).
OPTIONAL_COLUMNS = {"sp_degree": "1", "mask_ratio": "1", "groups": "", "slot": ""}

# Methods are tried in this order; a later one must beat an earlier one's held-out error by
# more than this factor to be chosen.
SIMPLER_WINS_WITHIN = 1.05

MEGA = 1e6  # pixels are fitted in megapixels, which keeps the normal equations well scaled


class ProfileError(ValueError):
    """A profile CSV is malformed or inconsistent."""


class UnknownModelError(LookupError):
    """The cost model has no profile for this model (or not for this component)."""


def _skipped_cfg_share(spec: "RequestSpec") -> float:
    """A request's expected unconditional rows skipped a step (skip-CFG): one row over the share
    of its steps from its first skipping step on."""
    first = spec.skip_cfg_step
    return 0.0 if first is None else (spec.steps_to_run - first) / spec.steps_to_run


@dataclass(frozen=True)
class BatchShape:
    """One denoiser forward of one batch of same-shape rows, split over `sp_degree` workers by
    sequence parallelism (1: on one worker).

    Images are one frame; a video multiplies the work per row by its frames. Later dimensions of
    the work (patches) extend this with defaulted fields, so every cost question keeps one
    argument. Add-ons: the forward makes one ControlNet call per ControlNet its members use, over
    those members' rows (`controlnet_rows`, one entry per call), and runs the unmerged updates of
    `lora_rows` rows x LoRAs.

    `mask_ratio` (InstGenIE): the share of the batch's tokens the forward computes, row-weighted
    (`computed_share` of each member); below 1 the rest reuses cached activations, which are
    loaded. One number suffices because both the work and the bytes to load are linear in each
    row's ratio (InstGenIE Table 1). `ProfiledCostModel` prices the full forward whatever it is
    (it fits full forwards only); `policies/instgenie/edit_costs.MaskAwareCosts` prices what the
    cache saves.
    """

    model: str
    height: int
    width: int
    rows: int  # batch rows: 2 per CFG request, 1 per non-CFG request
    frames: int = 1
    sp_degree: int = 1
    controlnet_rows: tuple[int, ...] = ()
    lora_rows: int = 0
    # One CFG request's two rows on two workers, a row each (latent parallelism): each runs the
    # forward of half the rows, add-ons included, and they swap their outputs.
    cfg_split: bool = False
    mask_ratio: float = 1.0
    # The expected share of its rows that skip the later blocks (step caching, row-weighted
    # `step_cache_costs.expected_skip_share` of each member); a forward with add-ons never skips.
    skip_share: float = 0.0
    # The expected share of its rows that are unconditional rows skipped (SynerDiff's skip-CFG,
    # `RequestSpec.skip_cfg_from`: each CFG member's later steps run its conditional row alone);
    # a forward with add-ons never skips.
    cfg_skip_share: float = 0.0

    def __post_init__(self) -> None:
        for field in ("height", "width", "rows", "frames", "sp_degree"):
            _check_int(field, getattr(self, field), 1)
        for rows in self.controlnet_rows:
            _check_int("controlnet_rows", rows, 1)
        _check_int("lora_rows", self.lora_rows, 0)
        for field in ("mask_ratio", "skip_share", "cfg_skip_share"):
            value = getattr(self, field)
            if isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"BatchShape.{field} must be in [0, 1], got {value!r}")
        if self.cfg_split and (self.rows != 2 or self.sp_degree != 1):
            raise ValueError(f"a CFG split is one request's 2 rows at sp_degree 1, got {self.rows} at "
                             f"{self.sp_degree}")

    @classmethod
    def of(cls, specs: "Sequence[RequestSpec]", group: "StepGroup | None" = None) -> "BatchShape":
        """The forward of these same-shape requests as `group` runs them (None: on one worker),
        add-ons included. A ControlNet is counted for every step, also outside its start/end
        window (it is idle for a few steps at most)."""
        head = specs[0]
        calls: dict[str, int] = {}
        for spec in specs:
            for name in dict.fromkeys(use.name for use in spec.controlnets):
                calls[name] = calls.get(name, 0) + spec.rows
        split = group is not None and bool(group.ranks) and group.split is GroupSplit.CFG
        degree = 1 if group is None or split else max(1, len(group.ranks))
        rows = sum(s.rows for s in specs)
        lora_rows = sum(s.rows * len(s.loras) for s in specs)
        plain = not (calls or lora_rows or (group is not None and group.ranks))  # (only plain groups cache steps)
        skip = sum(s.rows * expected_skip_share(s.step_cache) for s in specs) / rows if plain else 0.0
        cfg_skip = sum(_skipped_cfg_share(s) for s in specs) / rows if plain else 0.0
        return cls(head.model, head.height, head.width, rows, head.num_frames, degree, tuple(calls.values()),
                   lora_rows, split, sum(s.rows * computed_share(s) for s in specs) / rows, skip, cfg_skip)

    def half(self) -> "BatchShape":
        """What each worker of a CFG split runs: one of the two rows, with its share of the add-ons."""
        return replace(self, rows=self.rows // 2, controlnet_rows=tuple(r // 2 for r in self.controlnet_rows),
                       lora_rows=self.lora_rows // 2, cfg_split=False)

    @property
    def pixels(self) -> int:
        return self.height * self.width * self.frames

    @property
    def uses_cache(self) -> bool:
        """Some of its rows reuse cached activations (and load them)."""
        return self.mask_ratio < 1.0


def computed_share(request: "RequestSpec | RequestView") -> float:
    """The share of a request's tokens its forward computes: an edit of a template (whose
    activations the store keeps) computes its masked share and reuses the rest; any other
    request, an edit of an unseen image included, computes everything."""
    return request.mask_ratio if request.template_id is not None else 1.0


def _check_int(field: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"BatchShape.{field} must be an int >= {least}, got {value!r}")


@runtime_checkable
class CostModel(Protocol):
    """Latencies in seconds on one device. Policies and the simulator code against this."""

    def denoise_seconds(self, batch: BatchShape) -> float:
        """One forward of one batch at its SP degree, with its add-ons."""

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        """One worker round: its batches one after another, plus the per-round overhead."""

    def step_seconds(self, batch: BatchShape) -> float:
        """One round that runs just this batch (on each worker of its SP group): what one
        denoising step of its requests costs. +inf for an SP degree the device cannot run, so a
        scheduler never picks it."""

    def text_encode_seconds(self, model: str, texts: int) -> float:
        """One text-encoder call for `texts` strings."""

    def decode_seconds(self, model: str, height: int, width: int, frames: int = 1) -> float:
        """VAE decode + encode to a file (PNG, or a video's frames) of one image or video."""

    def request_overhead_seconds(self, model: str) -> float:
        """Fixed per-request cost outside the above (HTTP, ingress, hops, admission)."""

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        """One request alone on one worker: encode + steps * round + decode + overhead
        (SLO = sigma * solo)."""


# -- the CSV ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileRow:
    model: str
    device: str
    component: str
    height: int
    width: int
    rows: int
    frames: int
    latency_ms: float
    samples: int
    source: str
    sp_degree: int = 1
    mask_ratio: float = 1.0
    groups: tuple[tuple[int, int, int], ...] = ()  # (height, width, rows) of each group of a packed forward
    slot: int | None = None  # the cache slot of a block row (`BLOCK_COMPONENTS`), else None

    def __post_init__(self) -> None:
        if not self.model:
            raise ProfileError("model must not be empty")
        if self.component not in COMPONENTS:
            raise ProfileError(f"unknown component {self.component!r}; known: {list(COMPONENTS)}")
        if min(self.height, self.width) < 0 or self.rows < 1 or self.frames < 1 or self.samples < 1:
            raise ProfileError(f"bad sizes in {self}")
        if self.sp_degree < 1 or (self.sp_degree > 1 and self.component != DENOISE):
            raise ProfileError(f"sp_degree must be 1, or > 1 on denoise rows only: {self}")
        if not 0.0 < self.mask_ratio <= 1.0 or (self.mask_ratio < 1.0 and (
                self.component not in (DENOISE, BLOCK_CACHED) or self.sp_degree != 1 or self.frames != 1)):
            raise ProfileError(f"mask_ratio must be in (0, 1], and < 1 on image denoise or block_cached rows at "
                               f"sp_degree 1 only: {self}")
        if (self.slot is not None) != (self.component in BLOCK_COMPONENTS) or (self.slot or 0) < 0:
            raise ProfileError(f"block rows ({', '.join(BLOCK_COMPONENTS)}) and only they name a slot >= 0: {self}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ProfileError(f"latency_ms must be finite and >= 0, got {self.latency_ms!r}")
        shaped = self.height > 0 and self.width > 0
        if (self.height > 0) != (self.width > 0):
            raise ProfileError(f"height and width must both be 0 or both positive: {self}")
        if self.component in SHAPED and not shaped:
            raise ProfileError(f"{self.component} rows need a height and width: {self}")
        if self.groups:
            self._check_groups()

    def _check_groups(self) -> None:
        sizes = [(h, w) for h, w, _ in self.groups]
        if self.component != DENOISE or self.sp_degree != 1 or self.frames != 1 or self.mask_ratio < 1.0:
            raise ProfileError(f"groups belong to full image denoise rows at sp_degree 1 only: {self}")
        if len(self.groups) < 2 or len(set(sizes)) != len(sizes) or min(min(g) for g in self.groups) < 1:
            raise ProfileError(f"a packed forward has two or more groups of distinct sizes and positive rows: {self}")
        largest = max(sizes, key=lambda s: s[0] * s[1])
        if (self.height, self.width) != largest or self.rows != sum(r for _, _, r in self.groups):
            raise ProfileError(f"a packed row's height and width are its largest group's ({largest[0]}x{largest[1]}) "
                               f"and its rows all groups' ({sum(r for _, _, r in self.groups)}): {self}")

    @property
    def pixels(self) -> int:
        return self.height * self.width * self.frames

    @property
    def seconds(self) -> float:
        return self.latency_ms / 1000.0

    @property
    def measured(self) -> bool:
        """Timed on its device by `stepserve profile`, not derived from published figures."""
        return self.source.startswith("measured")

    def to_csv(self) -> dict[str, str]:
        return {
            "model": self.model, "device": self.device, "component": self.component,
            "height": str(self.height), "width": str(self.width), "rows": str(self.rows),
            "frames": str(self.frames), "latency_ms": f"{self.latency_ms:.4f}", "samples": str(self.samples),
            "source": self.source, "sp_degree": str(self.sp_degree), "mask_ratio": f"{self.mask_ratio:.6g}",
            "groups": format_groups(self.groups), "slot": "" if self.slot is None else str(self.slot),
        }


def format_groups(groups: Sequence[tuple[int, int, int]]) -> str:
    """(height, width, rows) groups as the CSV writes them: `2@64x64+4@128x128`."""
    return "+".join(f"{rows}@{height}x{width}" for height, width, rows in groups)


def parse_groups(text: str) -> tuple[tuple[int, int, int], ...]:
    """`format_groups`' inverse; empty text: no groups. Raises ValueError on anything else."""
    if not text.strip():
        return ()
    groups = []
    for part in text.split("+"):
        rows, _, size = part.strip().partition("@")
        height, _, width = size.partition("x")
        groups.append((int(height), int(width), int(rows)))
    return tuple(groups)


def _parse_row(raw: dict[str, str], where: str) -> ProfileRow:
    try:
        return ProfileRow(
            model=raw["model"].strip(), device=raw["device"].strip(), component=raw["component"].strip(),
            height=int(raw["height"]), width=int(raw["width"]), rows=int(raw["rows"]), frames=int(raw["frames"]),
            latency_ms=float(raw["latency_ms"]), samples=int(raw["samples"]), source=(raw["source"] or "").strip(),
            sp_degree=int(raw.get("sp_degree") or OPTIONAL_COLUMNS["sp_degree"]),
            mask_ratio=float(raw.get("mask_ratio") or OPTIONAL_COLUMNS["mask_ratio"]),
            groups=parse_groups(raw.get("groups") or OPTIONAL_COLUMNS["groups"]),
            slot=int(raw["slot"]) if (raw.get("slot") or "").strip() else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{where}: {exc}") from None


def read_profile(path: str | os.PathLike) -> list[ProfileRow]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or ()) and c not in OPTIONAL_COLUMNS]
        if missing:
            raise ProfileError(f"{path}: missing columns {missing}; expected {list(CSV_COLUMNS)}")
        return [_parse_row(raw, f"{path}:{reader.line_num}") for raw in reader]


def write_profile(path: str | os.PathLike, rows: Iterable[ProfileRow]) -> None:
    """Write rows sorted by model, component, shape: diffs between two profiles stay readable."""
    ordered = sorted(rows, key=lambda r: (r.model, COMPONENTS.index(r.component), r.sp_degree, -r.mask_ratio,
                                          len(r.groups), r.groups, r.pixels, r.height, r.rows, r.slot or 0))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in ordered:
            writer.writerow(row.to_csv())


# -- fitting: small, exact, pure-Python numerics ----------------------------------------------

Predictor = Callable[[tuple[float, ...]], float]
Method = Callable[[list[tuple[tuple[float, ...], float]]], Predictor]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _nnls(features: Callable[[tuple[float, ...]], tuple[float, ...]]) -> Method:
    """Least squares of the *relative* error with non-negative coefficients.

    Every feature is non-decreasing in every input, so non-negative coefficients make the fit
    monotone. The exact optimum is the best unconstrained solution, over supports (subsets of
    features), that comes out non-negative: with five features or fewer that is 31 solves.
    """

    def fit(points: list[tuple[tuple[float, ...], float]]) -> Predictor:
        rows = [[v / y for v in features(x)] for x, y in points]  # row scaled by 1/y: relative error
        k = len(rows[0])
        gram = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
        rhs = [sum(r[i] for r in rows) for i in range(k)]
        best: tuple[float, list[float]] | None = None
        for size in range(1, k + 1):
            for support in itertools.combinations(range(k), size):
                sol = _solve([[gram[i][j] for j in support] for i in support], [rhs[i] for i in support])
                if sol is None or min(sol) < -1e-12:
                    continue
                coef = [0.0] * k
                for i, v in zip(support, sol):
                    coef[i] = max(v, 0.0)
                # ||A c - 1||^2 up to the constant term: c'Gc - 2 c'h
                obj = sum(coef[i] * gram[i][j] * coef[j] for i in range(k) for j in range(k))
                obj -= 2 * sum(coef[i] * rhs[i] for i in range(k))
                if best is None or obj < best[0] - 1e-15:
                    best = (obj, coef)
        if best is None:
            raise ValueError("no non-negative least-squares solution")
        coef = best[1]
        return lambda x: sum(c * v for c, v in zip(coef, features(x)))

    return fit


def _isotonic(ys: list[float]) -> list[float]:
    """Pool adjacent violators: the closest non-decreasing sequence (least squares)."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out.extend([s / c] * int(c))
    return out


class _Curve:
    """Piecewise-linear, non-decreasing interpolation through (x, y) points; linear beyond the
    ends with the end segments' slopes, and never below proportional scaling toward zero."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]):
        pairs = sorted(zip(xs, ys))
        self.xs = [x for x, _ in pairs]
        self.ys = _isotonic([y for _, y in pairs])

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0]
        if x <= xs[0]:
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            linear = ys[0] - (xs[0] - x) * slope
            return max(linear, ys[0] * x / xs[0]) if xs[0] > 0 else linear
        if x >= xs[-1]:
            return ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        hi = next(i for i, v in enumerate(xs) if v >= x)
        w = (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1])
        return ys[hi - 1] * (1 - w) + ys[hi] * w


def _fit_curve(points: list[tuple[tuple[float, ...], float]]) -> Predictor:
    curve = _Curve([x[0] for x, _ in points], [y for _, y in points])
    return lambda x: curve(x[0])


def _fit_grid(points: list[tuple[tuple[float, ...], float]]) -> Predictor:
    """Denoise over (megapixels, rows): a rows curve per measured resolution, interpolated
    linearly in pixels between resolutions and extrapolated linearly beyond them.

    Each resolution's curve is the running max of the curves below it, so a larger image never
    costs less; the slope used above the largest resolution is a running max over rows, so
    extrapolated latency still grows with rows.
    """
    by_res: dict[float, list[tuple[float, float]]] = {}
    for (mpx, rows), y in points:
        by_res.setdefault(mpx, []).append((rows, y))
    res = sorted(by_res)
    curves = [_Curve([r for r, _ in by_res[p]], [y for _, y in by_res[p]]) for p in res]
    knots = sorted({r for pts in by_res.values() for r, _ in pts})

    def level(i: int, rows: float) -> float:
        return max(curves[j](rows) for j in range(i + 1))

    def slope(i: int, rows: float) -> float:  # between resolution i-1 and i
        return max(0.0, (level(i, rows) - level(i - 1, rows)) / (res[i] - res[i - 1]))

    def predict(x: tuple[float, ...]) -> float:
        mpx, rows = x
        if len(res) == 1:
            return curves[0](rows) * mpx / res[0]
        if mpx >= res[-1]:
            k = len(res) - 1
            s = max([slope(k, rows)] + [slope(k, r) for r in knots if r <= rows])
            return level(k, rows) + (mpx - res[-1]) * s
        if mpx <= res[0]:
            s_min = min(slope(1, r) for r in knots)
            base = level(0, rows)
            return max(base - (res[0] - mpx) * s_min, base * mpx / res[0])
        hi = next(i for i, p in enumerate(res) if p >= mpx)
        w = (mpx - res[hi - 1]) / (res[hi] - res[hi - 1])
        return level(hi - 1, rows) * (1 - w) + level(hi, rows) * w

    return predict


def _constant(points: list[tuple[tuple[float, ...], float]]) -> Predictor:
    ys = sorted(y for _, y in points)
    mid = len(ys) // 2
    value = ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2
    return lambda x: value


def _features_denoise_linear(x):
    mpx, rows = x
    return (1.0, rows, mpx, rows * mpx)


def _features_denoise_quadratic(x):
    mpx, rows = x
    return (1.0, rows, mpx, rows * mpx, rows * mpx * mpx)


# Candidate methods per component, simplest first.
_METHODS: dict[str, tuple[tuple[str, Method], ...]] = {
    DENOISE: (
        ("linear", _nnls(_features_denoise_linear)),
        ("quadratic", _nnls(_features_denoise_quadratic)),
        ("grid", _fit_grid),
    ),
    TEXT_ENCODE: (("linear", _nnls(lambda x: (1.0, x[0]))), ("interp", _fit_curve)),
    VAE_DECODE: (
        ("linear", _nnls(lambda x: (1.0, x[0]))),
        ("quadratic", _nnls(lambda x: (1.0, x[0], x[0] * x[0]))),
        ("interp", _fit_curve),
    ),
    ROUND_OVERHEAD: (("constant", _constant), ("linear", _nnls(lambda x: (1.0, x[1], x[1] * x[0])))),
}
for _extra in EXTRA_COMPONENTS:  # each a forward (or what it moves) over rows at a shape, as denoise
    _METHODS[_extra] = _METHODS[DENOISE]


@dataclass(frozen=True)
class FitResult:
    method: str
    points: int
    loo_mean: float | None  # leave-one-out relative error of the chosen method; None with < 3 points
    loo_max: float | None
    candidates: dict[str, tuple[float, float]]  # method -> (mean, max) held-out relative error


def _loo(method: Method, points) -> tuple[float, float]:
    errors = []
    for i, (x, y) in enumerate(points):
        try:
            pred = method(points[:i] + points[i + 1 :])(x)
        except (ValueError, ZeroDivisionError, StopIteration):
            return math.inf, math.inf
        errors.append(abs(pred - y) / y if y > 0 else abs(pred))
    return sum(errors) / len(errors), max(errors)


def _merge_duplicates(points) -> list[tuple[tuple[float, ...], float]]:
    grouped: dict[tuple[float, ...], list[float]] = {}
    for x, y in points:
        grouped.setdefault(x, []).append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in sorted(grouped.items())]


def _fit(component: str, points) -> tuple[Predictor, FitResult]:
    points = _merge_duplicates(points)
    methods = _METHODS[component]
    if len(points) < 3:  # too few points to hold one out and still fit; take the simplest that fits
        for name, method in methods:
            try:
                return method(points), FitResult(name, len(points), None, None, {})
            except (ValueError, ZeroDivisionError, StopIteration):
                continue
        raise ProfileError(f"cannot fit {component} from {len(points)} points")
    scores = {name: _loo(method, points) for name, method in methods}
    best = min(mean for mean, _ in scores.values())
    if not math.isfinite(best):
        raise ProfileError(f"cannot fit {component} from {len(points)} points")
    name, method = next((n, m) for n, m in methods if scores[n][0] <= best * SIMPLER_WINS_WITHIN + 1e-12)
    mean, worst = scores[name]
    return method(points), FitResult(name, len(points), mean, worst, scores)


# -- the fitted model ------------------------------------------------------------------------


class _ModelCosts:
    """Fitted curves of one model on one device."""

    def __init__(self, model: str, rows: list[ProfileRow]):
        self.model = model
        devices = sorted({r.device for r in rows})
        if len(devices) != 1:
            raise ProfileError(f"model {model!r}: rows from several devices {devices}; load one device at a time")
        self.device = devices[0]
        self.sources = sorted({r.source for r in rows})
        by_component: dict[str, list[ProfileRow]] = {c: [] for c in COMPONENTS}
        self.masked: list[ProfileRow] = []  # forwards with cached activations: not fitted here
        self.packed: list[ProfileRow] = []  # forwards of several resolutions: not fitted here
        self.blocks: list[ProfileRow] = []  # per-slot costs of masked forwards: not fitted here
        for r in rows:
            (self.blocks if r.slot is not None else self.masked if r.mask_ratio < 1.0 else self.packed if r.groups
             else by_component[r.component]).append(r)
        self.fits: dict[str, FitResult] = {}
        degrees = sorted({r.sp_degree for r in by_component[DENOISE]})
        # One fit per SP degree; degree 1 reports as plain "denoise", others as "denoise@spD".
        self._denoise = {
            d: self._fit(DENOISE, [((r.pixels / MEGA, float(r.rows)), r.seconds)
                                   for r in by_component[DENOISE] if r.sp_degree == d],
                         label=DENOISE if d == 1 else f"{DENOISE}@sp{d}")
            for d in degrees
        }
        self._text = self._fit(TEXT_ENCODE, [((float(r.rows),), r.seconds) for r in by_component[TEXT_ENCODE]])
        self._vae = self._fit(VAE_DECODE, [((r.pixels / MEGA,), r.seconds) for r in by_component[VAE_DECODE]])
        fixed = [r.seconds for r in by_component[ROUND_OVERHEAD] if r.height == 0]
        self.round_fixed = sorted(fixed)[len(fixed) // 2] if fixed else 0.0
        self._per_group = self._fit(
            ROUND_OVERHEAD, [((r.pixels / MEGA, float(r.rows)), r.seconds) for r in by_component[ROUND_OVERHEAD]
                             if r.height > 0]
        )
        self.request_overhead = _median_seconds(by_component[REQUEST_OVERHEAD])
        self.host_idle_cores = _median_seconds(by_component[HOST_IDLE])  # CPU seconds per second
        self.router_cpu = _median_seconds(by_component[ROUTER_CPU])
        self._addons = {c: self._fit(c, [((r.pixels / MEGA, float(r.rows)), r.seconds) for r in by_component[c]])
                        for c in EXTRA_COMPONENTS}
        self.lora_load = _median_seconds(by_component[LORA_LOAD])
        optional = (*HOST_COMPONENTS, *EXTRA_COMPONENTS, LORA_LOAD, *BLOCK_COMPONENTS)
        self.missing = [c for c in COMPONENTS if not by_component[c] and c not in optional]
        self.missing_extras = [c for c in (*EXTRA_COMPONENTS, LORA_LOAD) if not by_component[c]]
        self.host_slowdowns = _host_slowdowns(by_component[HOST_PROBE])
        self._cache: dict[tuple, float] = {}

    def _fit(self, component: str, points, label: str | None = None) -> Predictor | None:
        if not points:
            return None
        predictor, result = _fit(component, points)
        self.fits[label or component] = result
        return predictor

    @property
    def sp_degrees(self) -> tuple[int, ...]:
        return tuple(self._denoise)

    def _need(self, predictor: Predictor | None, component: str) -> Predictor:
        if predictor is None:
            raise UnknownModelError(f"model {self.model!r} has no {component} rows in its profile")
        return predictor

    def denoise(self, pixels: int, rows: int, sp_degree: int = 1) -> float:
        key = (DENOISE, pixels, rows, sp_degree)
        if key not in self._cache:
            if sp_degree not in self._denoise and sp_degree > 1 and 1 in self._denoise:
                raise UnknownModelError(f"model {self.model!r} has no denoise rows at sp_degree {sp_degree}; "
                                        f"profiled degrees: {list(self._denoise)}")
            fit = self._need(self._denoise.get(sp_degree), DENOISE)
            self._cache[key] = max(0.0, fit((pixels / MEGA, float(rows))))
        return self._cache[key]

    def addon(self, component: str, pixels: int, rows: int) -> float:
        """An add-on component's seconds over rows at a shape; 0 when not profiled."""
        fit = self._addons[component]
        if fit is None or rows == 0:
            return 0.0
        key = (component, pixels, rows)
        if key not in self._cache:
            self._cache[key] = max(0.0, fit((pixels / MEGA, float(rows))))
        return self._cache[key]

    def per_group_overhead(self, pixels: int, rows: int) -> float:
        if self._per_group is None:
            return 0.0
        key = (ROUND_OVERHEAD, pixels, rows)
        if key not in self._cache:
            self._cache[key] = max(0.0, self._per_group((pixels / MEGA, float(rows))))
        return self._cache[key]

    def text(self, texts: int) -> float:
        key = (TEXT_ENCODE, texts)
        if key not in self._cache:
            self._cache[key] = max(0.0, self._need(self._text, TEXT_ENCODE)((float(texts),)))
        return self._cache[key]

    def vae(self, pixels: int) -> float:
        key = (VAE_DECODE, pixels)
        if key not in self._cache:
            self._cache[key] = max(0.0, self._need(self._vae, VAE_DECODE)((pixels / MEGA,)))
        return self._cache[key]


def _median_seconds(rows: list[ProfileRow]) -> float:
    """The (upper) median of the rows' seconds; 0.0 for none."""
    values = sorted(r.seconds for r in rows)
    return values[len(values) // 2] if values else 0.0


def _host_slowdowns(probes: list[ProfileRow]) -> dict[int, float]:
    """Concurrent copies -> median over probe shapes of (time with them) / (time alone)."""
    alone = {(r.height, r.width): r.seconds for r in probes if r.rows == 1}
    ratios: dict[int, list[float]] = {}
    for r in probes:
        base = alone.get((r.height, r.width))
        if r.rows > 1:
            if not base:
                raise ProfileError(f"host_probe at {r.height}x{r.width} with {r.rows} copies has no alone (rows=1) row")
            ratios.setdefault(r.rows, []).append(r.seconds / base)
    return {k: sorted(v)[len(v) // 2] for k, v in sorted(ratios.items())}


class ProfiledCostModel:
    """A `CostModel` fitted from profile rows: one device, any number of models. `controlnets`:
    where ControlNets run, which decides what they add to a forward (`addon_costs`)."""

    def __init__(self, rows: Iterable[ProfileRow], controlnets: ControlNetPlacement = ControlNetPlacement.INLINE):
        self.controlnets = ControlNetPlacement(controlnets)
        self.profile_rows = tuple(rows)  # as given: what the fits summarise (the Throughput Analyzer trains on them)
        by_model: dict[str, list[ProfileRow]] = {}
        for row in self.profile_rows:
            by_model.setdefault(row.model, []).append(row)
        if not by_model:
            raise ProfileError("no profile rows")
        self._models = {name: _ModelCosts(name, model_rows) for name, model_rows in by_model.items()}

    @classmethod
    def from_csv(cls, *paths: str | os.PathLike,
                 controlnets: ControlNetPlacement = ControlNetPlacement.INLINE) -> "ProfiledCostModel":
        if not paths:
            raise ValueError("give at least one profile CSV")
        return cls([row for path in paths for row in read_profile(path)], controlnets)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self._models))

    @property
    def masked_rows(self) -> tuple[ProfileRow, ...]:
        """The denoise rows of forwards with cached activations (mask_ratio < 1), which this model
        does not fit: `policies/instgenie/edit_profile.py` prices edits from them."""
        return tuple(r for costs in self._models.values() for r in costs.masked)

    @property
    def block_rows(self) -> tuple[ProfileRow, ...]:
        """The per-slot costs of masked forwards (`BLOCK_COMPONENTS`), which this model does not
        fit: `policies/instgenie/block_profile.py` hands them to the loading DP."""
        return tuple(r for costs in self._models.values() for r in costs.blocks)

    @property
    def packed_rows(self) -> tuple[ProfileRow, ...]:
        """The denoise rows of forwards of several resolutions (`groups`), which this model does
        not fit: `policies/patchedserve/packed_profile.py` checks and calibrates packed pricing
        against them."""
        return tuple(r for costs in self._models.values() for r in costs.packed)

    def _costs(self, model: str) -> _ModelCosts:
        try:
            return self._models[model]
        except KeyError:
            raise UnknownModelError(f"no profile for model {model!r}; profiled: {list(self.models)}") from None

    # -- CostModel ---------------------------------------------------------------------------

    def denoise_seconds(self, batch: BatchShape) -> float:
        """Raises `UnknownModelError` for an SP degree the profile lacks: each degree is fitted
        on its own, and communication's share does not extrapolate from the others."""
        if batch.cfg_split:
            return self.denoise_seconds(batch.half()) + self._costs(batch.model).addon(CFG_EXCHANGE, batch.pixels,
                                                                                      batch.rows)
        if not (batch.controlnet_rows or batch.lora_rows):
            # Skipped unconditional rows are priced as rows the forward does not run (linear in rows).
            full = self._costs(batch.model).denoise(batch.pixels, batch.rows, batch.sp_degree)
            full *= 1.0 - batch.cfg_skip_share
            return full * cached_forward_share(batch.skip_share) if batch.skip_share else full
        return forward_seconds(*self.forward_parts(batch), self.controlnets)

    def forward_parts(self, batch: BatchShape) -> tuple[float, float, list[tuple[float, float]], float]:
        """What `addon_costs.forward_seconds` combines: the UNet's seconds, its encoder half's,
        (compute, transfer) of each ControlNet call, and the unmerged LoRA updates'."""
        costs = self._costs(batch.model)
        pixels = batch.pixels
        calls = [(costs.addon(CONTROLNET, pixels, rows), costs.addon(CONTROLNET_TRANSFER, pixels, rows))
                 for rows in batch.controlnet_rows]
        return (costs.denoise(pixels, batch.rows, batch.sp_degree), costs.addon(DENOISE_ENCODER, pixels, batch.rows),
                calls, costs.addon(LORA, pixels, batch.lora_rows))

    def lora_load_seconds(self, model: str) -> float:
        """Bringing one LoRA from the node's store into a worker's device memory (0 when never
        profiled): what a batch waits when a request brings a LoRA its worker lacks."""
        return self._costs(model).lora_load

    def controlnet_seconds(self, batch: BatchShape) -> float:
        """The ControlNet service's device time for the batch's calls (0 inline: the denoiser's)."""
        if self.controlnets is ControlNetPlacement.INLINE:
            return 0.0
        costs = self._costs(batch.model)
        return sum(costs.addon(CONTROLNET, batch.pixels, rows) for rows in batch.controlnet_rows)

    def round_overhead_seconds(self, batches: Sequence[BatchShape]) -> float:
        """Beyond the forwards: one fixed cost per round (the plan/report RPC; the largest of the
        models present, as one message carries all batches) plus bookkeeping per batch."""
        if not batches:
            return 0.0
        fixed = max(self._costs(b.model).round_fixed for b in batches)
        return fixed + sum(self._costs(b.model).per_group_overhead(b.pixels, b.rows) for b in batches)

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        """A worker runs its batches one after another; an empty round costs nothing."""
        return sum(self.denoise_seconds(b) for b in batches) + self.round_overhead_seconds(batches)

    def step_seconds(self, batch: BatchShape) -> float:
        """Every worker of an SP group runs the same round, so a step at degree d is the forward
        at d plus one round's overhead. A degree the profile lacks is +inf rather than an error:
        schedulers ask about every degree they could choose."""
        costs = self._costs(batch.model)
        # A model without any denoise rows still raises (in `denoise`): that is a broken
        # profile, and +inf would leave its requests waiting forever without a word.
        if costs.sp_degrees and batch.sp_degree not in costs.sp_degrees:
            return math.inf
        return self.denoise_seconds(batch) + self.round_overhead_seconds((batch,))

    def text_encode_seconds(self, model: str, texts: int) -> float:
        if texts < 1:
            raise ValueError(f"texts must be >= 1, got {texts}")
        return self._costs(model).text(texts)

    def decode_seconds(self, model: str, height: int, width: int, frames: int = 1) -> float:
        if height < 1 or width < 1 or frames < 1:
            raise ValueError(f"bad size {width}x{height}x{frames} frames")
        return self._costs(model).vae(height * width * frames)

    def sp_degrees(self, model: str) -> tuple[int, ...]:
        """The sequence-parallel degrees this model's denoise was profiled at."""
        return self._costs(model).sp_degrees

    def video_step_seconds(self, model: str, height: int, width: int, frames: int, degree: int,
                           cfg: bool = True) -> float:
        """`step_seconds` of one video, raising for an unprofiled degree: what `stepserve profile`
        prints after a video profile (stepserve/profiling/video.py)."""
        batch = BatchShape(model, height, width, 2 if cfg else 1, frames, degree)
        return self.denoise_seconds(batch) + self.round_overhead_seconds((batch,))

    def request_overhead_seconds(self, model: str) -> float:
        return self._costs(model).request_overhead

    def host_slowdown(self, busy: int) -> float:
        """How much slower one job runs while `busy` jobs (itself included, at most one per
        core) compute on this host at once: 1 when alone or never probed; between probed
        counts, linear; beyond the largest, that one's."""
        measured = {1: 1.0}
        for costs in self._models.values():  # one host: any model's probe will do
            measured.update(costs.host_slowdowns)
        if busy <= 1 or len(measured) == 1:
            return 1.0
        counts = sorted(measured)
        if busy >= counts[-1]:
            return max(1.0, measured[counts[-1]])
        hi = next(k for k in counts if k >= busy)
        lo = max(k for k in counts if k < busy)
        share = (busy - lo) / (hi - lo)
        return max(1.0, measured[lo] + share * (measured[hi] - measured[lo]))

    def host_idle_cores(self) -> float:
        """Cores the rest of a CPU host keeps busy with the app idle (0 when never measured). One
        host, one app: the largest any model's profile measured."""
        return max(costs.host_idle_cores for costs in self._models.values())

    def router_cpu_seconds(self) -> float:
        """The router's CPU per denoising step, beside the workers' steps (0 when never measured);
        one router for every model: the largest measured."""
        return max(costs.router_cpu for costs in self._models.values())

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        """The prompt (and, with CFG, the negative prompt) encoded in one call, `steps` rounds of
        one batch alone on one worker (a video at SP degree 1), one decode, and the fixed
        per-request overhead."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        rows = 2 if cfg else 1
        return (
            self.text_encode_seconds(model, rows)
            + steps * self.round_seconds([BatchShape(model, height, width, rows, frames)])
            + self.decode_seconds(model, height, width, frames)
            + self.request_overhead_seconds(model)
        )

    # -- reporting ---------------------------------------------------------------------------

    def device(self, model: str) -> str:
        return self._costs(model).device

    def fit_report(self) -> dict:
        """Per model and component: the chosen method and its leave-one-out relative error
        (mean and max over the grid points), with every candidate's score. `round_overhead`
        here is its per-group part; the fixed per-round cost is `round_fixed_ms`."""
        report: dict = {}
        for name in self.models:
            costs = self._models[name]
            components = {}
            for component, fit in costs.fits.items():
                components[component] = {
                    "method": fit.method, "points": fit.points,
                    "loo_mean_rel_err": fit.loo_mean, "loo_max_rel_err": fit.loo_max,
                    "candidates": {m: {"mean": mean, "max": worst} for m, (mean, worst) in fit.candidates.items()},
                }
            report[name] = {
                "device": costs.device,
                "components": components,
                "round_fixed_ms": costs.round_fixed * 1000,
                "request_overhead_ms": costs.request_overhead * 1000,
                "host_idle_cores": costs.host_idle_cores,
                "router_cpu_ms": costs.router_cpu * 1000,
                "lora_load_ms": costs.lora_load * 1000,
                "missing": costs.missing,
                "missing_extras": costs.missing_extras,
                "host_slowdown": {str(k): v for k, v in costs.host_slowdowns.items()},
                "sources": costs.sources,
            }
        return report


def format_fit_report(report: dict) -> str:
    """The fit report as a small text table."""
    lines = []
    for model, entry in report.items():
        lines.append(f"{model} ({entry['device']}): round fixed {entry['round_fixed_ms']:.3f} ms, "
                     f"request overhead {entry['request_overhead_ms']:.3f} ms"
                     + (f", missing {entry['missing']}" if entry["missing"] else "")
                     + (f", host idle {entry['host_idle_cores']:.3f} cores" if entry["host_idle_cores"] else "")
                     + (f", router {entry['router_cpu_ms']:.2f} ms CPU a step" if entry["router_cpu_ms"] else "")
                     + (f", a LoRA to a worker {entry['lora_load_ms']:.2f} ms" if entry["lora_load_ms"] else "")
                     + "".join(f", {k} busy cores: {v:.2f}x slower" for k, v in entry["host_slowdown"].items()))
        for component, fit in entry["components"].items():
            if fit["loo_mean_rel_err"] is None:
                err = "held-out error n/a (< 3 points)"
            else:
                err = f"held-out rel. error mean {fit['loo_mean_rel_err']:.1%}, max {fit['loo_max_rel_err']:.1%}"
            others = ", ".join(f"{m} {s['mean']:.1%}" for m, s in fit["candidates"].items() if m != fit["method"])
            label = f"{component}/group" if component == ROUND_OVERHEAD else component  # fixed part: above
            lines.append(f"  {label:<20} {fit['method']:<10} {fit['points']:>3} pts  {err}"
                         + (f"  (others: {others})" if others else ""))
    return "\n".join(lines)


def profile_path(name: str) -> Path:
    """Where a shipped profile named `name` lives (configs/profiles/<name>.csv)."""
    from importlib.resources import files

    return Path(str(files("stepserve.configs") / "profiles" / f"{name}.csv"))


def resolve_profile(name_or_path: str | os.PathLike) -> Path:
    """A path to a CSV, or the name of a shipped profile ("tiny-sd-cpu"), as a path."""
    path = Path(name_or_path)
    if path.suffix == ".csv" or path.exists():
        return path
    shipped = profile_path(str(name_or_path))
    if not shipped.exists():
        known = sorted(p.stem for p in shipped.parent.glob("*.csv")) if shipped.parent.exists() else []
        raise FileNotFoundError(f"no profile {str(name_or_path)!r}; shipped: {known}")
    return shipped


def load_profile(name_or_path: str | os.PathLike, *more: str | os.PathLike,
                 controlnets: ControlNetPlacement = ControlNetPlacement.INLINE) -> ProfiledCostModel:
    """One cost model from one or more profiles (names of shipped ones, or CSV paths): a
    co-serving router needs its image and its video model's."""
    return ProfiledCostModel.from_csv(*(resolve_profile(p) for p in (name_or_path, *more)), controlnets=controlnets)
