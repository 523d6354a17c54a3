"""`stepserve profile`'s add-on rows (SwiftDiffusion §4.1-§4.2): for a model whose config serves
ControlNets or LoRAs, the first of each, timed on the worker's device with the worker's threads.

- controlnet: one ControlNet call over `rows` rows, as a worker makes it (`control_residuals`);
- denoise_encoder: the denoiser's forward up to the end of its mid block (what a ControlNet on the
  service overlaps), read inside a whole forward by a hook on the mid block;
- lora: a forward with every row's unmerged update of the LoRA, less the same forward without it
  (the two interleaved, so drift hits both);
- lora_load: the LoRA's weights from host arrays (as the node's LoRA store hands them) onto the
  family's device, as a worker installs them.

Not measured: controlnet_transfer (the service's transport) and cfg_exchange (an all-gather
between two processes); a profile without them prices them at nothing, and says so.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from stepserve.engine.addons import ControlRows, LoraRows, StepAddons
from stepserve.engine.addons.controlnet import control_residuals
from stepserve.engine.addons.lora import from_arrays, to_arrays
from stepserve.engine.addons.source import AddonKind, controlnet_model, load_addon
from stepserve.engine.text_encoding import embed
from stepserve.policies.cost_model import CONTROLNET, DENOISE_ENCODER, LORA, LORA_LOAD, ProfileRow
from stepserve.profiling.common import PROMPT, Context, first_timestep, forward_inputs, log


def measure_addons(ctx: Context, app: Any, threads: int) -> list[ProfileRow]:
    """The add-on rows of `ctx`'s model, or none when it serves no add-ons."""
    family = ctx.family
    controlnets = [a for a in app.controlnets if a.model == ctx.model]
    loras = [a for a in app.loras if a.model == ctx.model]
    if not family.takes_addons or not (controlnets or loras):
        return []
    net = controlnet_model(controlnets[0].to_source(AddonKind.CONTROLNET), family.source) if controlnets else None
    if net is not None:
        family.add_controlnet(controlnets[0].name, net)  # on the family's device and dtype
        net = family.controlnets[controlnets[0].name]
    lora = None
    if loras:
        load_addon(loras[0].to_source(AddonKind.LORA), family)
        lora = loras[0].name
    log(f"[add-ons] ControlNet {controlnets[0].name if net else None!r}, LoRA {lora!r}, {threads} thread(s)")
    rows = _forwards(ctx, net, lora, threads)
    if lora is not None:
        rows.append(_lora_load(ctx, lora))
    return rows


def _forwards(ctx: Context, net: Any, lora: str | None, threads: int) -> list[ProfileRow]:
    family, grid = ctx.family, ctx.grid
    text = embed(family, PROMPT)
    t = first_timestep(family)
    generator = torch.Generator("cpu").manual_seed(0)
    out = []
    note = f"{threads} thread(s)"
    for size in grid.sizes:
        cases, plain = {}, {}
        for rows in grid.rows:
            sample, timesteps, cond = forward_inputs(family, text, t, rows, size, generator)
            plain[rows] = (lambda s=sample, ts=timesteps, c=cond: family.denoise(s, ts, c))
            if net is not None:
                image = torch.rand(rows, 3, size, size, generator=generator).to(family.device, family.dtype)
                uses = [ControlRows("profiled", slice(0, rows), image, 1.0)]
                inputs = family.denoiser_inputs(cond)
                cases[(CONTROLNET, rows)] = (lambda s=sample, ts=timesteps, i=inputs, u=uses:
                                             control_residuals({"profiled": net}, s, ts, i, u))
            if lora is not None:
                addons = StepAddons(loras=(LoraRows(lora, slice(0, rows), 1.0),))
                cases[(LORA, rows)] = (lambda s=sample, ts=timesteps, c=cond, a=addons: family.denoise(s, ts, c, addons=a))
        for (component, rows), seconds in _controlnet_and_lora(ctx, cases, plain, size).items():
            what = (f"control_residuals, {note}" if component == CONTROLNET else
                    f"denoise with the LoRA's unmerged update on every row less without (median of pairs), {note}")
            out.append(ctx.row(component, seconds, grid.repeats, size, size, rows, what))
        for rows, fn in plain.items():
            encoder = _encoder_seconds(ctx, fn, grid.warmup, grid.repeats)
            log(f"  {size}px encoder half rows {rows}: {encoder * 1e3:.3f} ms")
            out.append(ctx.row(DENOISE_ENCODER, encoder, grid.repeats, size, size, rows,
                               f"denoise to the end of its mid block, {note}"))
    return out


def _controlnet_and_lora(ctx: Context, cases: dict, plain: dict, size: int) -> dict:
    """ControlNet calls timed round-robin; a LoRA's extra as the median over repeats of (with
    less without) timed back to back: a difference of two medians drowns in a busy host's noise."""
    grid = ctx.grid
    for _ in range(grid.warmup):
        for fn in [*cases.values(), *plain.values()]:
            fn()
    times: dict = {key: [] for key in cases}
    for _ in range(grid.repeats):
        for (component, rows), fn in cases.items():
            seconds = ctx.watch.time(fn)
            times[(component, rows)].append(seconds - ctx.watch.time(plain[rows]) if component == LORA else seconds)
    out = {key: max(statistics.median(values), 0.0) for key, values in times.items()}
    for (component, rows), seconds in out.items():
        log(f"  {size}px {component} rows {rows}: {seconds * 1e3:.3f} ms")
    return out


def _encoder_seconds(ctx: Context, forward: Any, warmup: int, repeats: int) -> float:
    """Median time from a forward's start to its mid block's end."""
    marks: list[float] = []

    def hook(*_):
        ctx.watch.sync()
        marks.append(time.perf_counter())

    handle = ctx.family.denoiser.mid_block.register_forward_hook(hook)
    try:
        for _ in range(warmup):
            forward()
        times = []
        for _ in range(repeats):
            marks.clear()
            ctx.watch.sync()
            start = time.perf_counter()
            forward()
            times.append(marks[0] - start)
    finally:
        handle.remove()
    return statistics.median(times)


def _lora_load(ctx: Context, name: str) -> ProfileRow:
    family, grid = ctx.family, ctx.grid
    arrays = to_arrays(family.loras[name].to("cpu", torch.float32))
    times = []
    for _ in range(grid.warmup + grid.repeats):
        times.append(ctx.watch.time(lambda: family.add_lora(from_arrays(arrays))))
    seconds = statistics.median(times[grid.warmup:])
    log(f"  LoRA {name!r} to the device: {seconds * 1e3:.3f} ms")
    return ctx.row(LORA_LOAD, seconds, grid.repeats, note=f"LoRA {name!r} from host arrays onto the device")
