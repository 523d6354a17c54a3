"""`stepserve profile`'s packed rows (PatchedServe §4): for a model whose family runs several
resolutions in one forward (the packed forward mode: SD3's and Flux's tokens packed, SD1.5/SDXL's UNet
patched), that forward (`family.denoise_mixed`, as a worker with `workers.pack_resolutions`
serves it) for every mix of two or more of the grid's sizes, with `ProfileGrid.packed_batches`
requests of each size (CFG's two rows each where the model guides by CFG): denoise rows with
`groups`.

Each mix is timed round-robin with the same groups run one after another (`family.denoise` per
size, what a worker that does not pack runs), so the log says, side by side, what packing gains
or costs on this device; only the packed forwards become rows (the one-resolution forwards are
the grid's own rows).
"""

from __future__ import annotations

import itertools
import statistics

import torch

from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.text_encoding import embed
from stepserve.policies.cost_model import DENOISE, ProfiledCostModel, ProfileRow
from stepserve.policies.patchedserve import (PatchedServeConfig, holdout_error, measured_samples, packed,
                                             training_samples)
from stepserve.policies.patchedserve.packed_profile import packing_fits, packing_report
from stepserve.profiling.common import PROMPT, Context, first_timestep, forward_inputs, interleaved_times, log

PACKED, IN_TURN = "packed", "in turn"


def size_mixes(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every mix of two or more distinct sizes, smallest first."""
    distinct = sorted(set(sizes))
    return [mix for n in range(2, len(distinct) + 1) for mix in itertools.combinations(distinct, n)]


def measure_packed(ctx: Context, threads: int) -> list[ProfileRow]:
    """The packed rows of `ctx`'s model, or none where its family does not pack or the grid has
    fewer than two sizes."""
    family, grid = ctx.family, ctx.grid
    mixes = size_mixes(grid.sizes)
    if ModeName.PACKED not in family.forward_modes or not mixes or not grid.packed_batches:
        return []
    per_request = 2 if family.classifier_free_guidance else 1
    log(f"[denoise, packed] mixes of sizes {list(grid.sizes)}, {list(grid.packed_batches)} request(s) of "
        f"{per_request} row(s) per size, packed and in turn, {threads} thread(s)")
    text = embed(family, PROMPT)
    t = first_timestep(family)
    generator = torch.Generator("cpu").manual_seed(0)
    out = []
    for requests in grid.packed_batches:
        rows = requests * per_request
        inputs = {size: forward_inputs(family, text, t, rows, size, generator) for size in sorted(set(grid.sizes))}
        cases = {}
        for mix in mixes:
            members = [inputs[size] for size in mix]
            cases[mix, PACKED] = (lambda m=members: family.denoise_mixed(m))
            cases[mix, IN_TURN] = (lambda m=members: [family.denoise(*member) for member in m])
        times = interleaved_times(cases, ctx.watch, grid.warmup, grid.repeats)
        for mix in mixes:
            packed, in_turn = statistics.median(times[mix, PACKED]), statistics.median(times[mix, IN_TURN])
            sides = "+".join(str(size) for size in mix)
            log(f"  {sides}px rows {rows} each: packed {packed * 1e3:.3f} ms, in turn {in_turn * 1e3:.3f} ms "
                f"({packed / in_turn:.2f}x)")
            largest = max(mix)
            out.append(ctx.row(DENOISE, packed, grid.repeats, largest, largest, rows * len(mix),
                               f"family.denoise_mixed of {sides} px; the same groups in turn {in_turn * 1e3:.3f} ms, "
                               f"{threads} thread(s)", groups=tuple((size, size, rows) for size in mix)))
    return out


def packed_fit_report(profile: ProfiledCostModel, sizes: tuple[int, ...]) -> str:
    """How the packed pricing meets the profile's packed rows (`packing_report`), and how the
    Throughput Analyzer a packing router's patchedserve policy trains on `sizes` meets the measured
    batches it held out (`holdout_error`), one line each a model."""
    lines = [report.format(model) for model, report in packing_report(profile, profile).items()]
    config = PatchedServeConfig(sizes=tuple((size, size) for size in sizes))
    pricing = packed(profile, fits=packing_fits(profile, profile))
    for model in sorted({row.model for row in profile.packed_rows}):
        measured = measured_samples(profile.profile_rows, model, config.sizes, profile.round_overhead_seconds)
        samples = training_samples(pricing, model, config.sizes, config.training_batch, config.training_samples,
                                   config.seed, measured)
        lines.append(holdout_error(samples, config.seed)[1].format(model))
    return "\n".join(lines)
