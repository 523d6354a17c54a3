"""`stepserve profile` for an image model: the model's own work (denoise, round bookkeeping,
text encoding, decode, the host probe) and the command that runs every part."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stepserve.policies.cost_model import (
    DENOISE,
    HOST_PROBE,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    BatchShape,
    ProfiledCostModel,
    ProfileRow,
    format_fit_report,
    write_profile,
)
from stepserve.profiling.addons import measure_addons
from stepserve.profiling.common import (
    PROMPT,
    Context,
    Stopwatch,
    choose_grid,
    device_description,
    first_timestep,
    forward_inputs,
    interleaved_medians,
    log,
    set_threads,
)
from stepserve.profiling.edit_blocks import measure_edit_blocks
from stepserve.profiling.edits import masked_fit_report, measure_masked
from stepserve.profiling.live import live_rows, measure_live, measure_on_ray
from stepserve.profiling.packed import measure_packed, packed_fit_report
from stepserve.runtime import CONFIGS, load_serve_config


# -- the model's own work --------------------------------------------------------------------


def measure_denoise(ctx: Context, threads: int) -> list[ProfileRow]:
    from stepserve.engine.text_encoding import embed

    family, grid = ctx.family, ctx.grid
    log(f"[denoise] {len(grid.sizes)} sizes x rows {list(grid.rows)}, {threads} thread(s)")
    text = embed(family, PROMPT)
    t = first_timestep(family)
    generator = torch.Generator("cpu").manual_seed(0)
    rows_out = []
    for size in grid.sizes:  # sizes in turn (their costs differ ~16x); rows interleaved within a size
        cases = {}
        for rows in grid.rows:
            sample, timesteps, cond = forward_inputs(family, text, t, rows, size, generator)
            cases[rows] = (lambda s=sample, ts=timesteps, c=cond: family.denoise(s, ts, c))
        medians = interleaved_medians(cases, ctx.watch, grid.warmup, grid.repeats, lambda r: f"{size}px rows {r}")
        rows_out += [ctx.row(DENOISE, v, grid.repeats, size, size, r, f"family.denoise, {threads} thread(s)")
                     for r, v in medians.items()]
    return rows_out


class TimedFamily:
    """A family whose `denoise` calls are timed, so a round's overhead can be separated from
    its forwards inside one and the same `StepRunner.execute` call."""

    def __init__(self, family, watch: Stopwatch):
        self._family = family
        self._watch = watch
        self.denoise_s = 0.0

    def __getattr__(self, name: str):
        return getattr(self._family, name)

    def denoise(self, *args, **kwargs):
        out = None

        def run():
            nonlocal out
            out = self._family.denoise(*args, **kwargs)

        self.denoise_s += self._watch.time(run)
        return out


PROBE_ROUNDS = 20  # interleaved rounds of the host probe (each: alone, 1 copy beside, ...)


def _probe_sibling(source, threads: int, size: int, rows: int, running, stop, ready) -> None:
    """A sibling process: run the probe forward over and over while `running` is set."""
    from stepserve.engine.families import DENOISER, TEXT, load_family

    torch.set_num_threads(threads)
    family = load_family(source, {DENOISER, TEXT}, "cpu")
    forward = probe_forward(family, size, rows)
    forward()
    ready.put(True)
    while not stop.is_set():
        if running.wait(0.05):
            forward()


def probe_forward(family, size: int, rows: int) -> Callable[[], Any]:
    """One forward of `rows` rows of a `size` px image, ready to time (the host probe's unit of
    work, and the speed index of `load_tests.host_speed`)."""
    from stepserve.engine.text_encoding import conditioning_rows, embed

    side = size // family.vae_scale_factor
    sample = torch.randn(rows, family.latent_channels, side, side, generator=torch.Generator("cpu").manual_seed(0))
    cond = conditioning_rows(family, embed(family, PROMPT), rows, size, size)
    timesteps = first_timestep(family).reshape(1).expand(rows)
    return lambda: family.denoise(sample, timesteps, cond)


def measure_host_probe(ctx: Context, source, threads: int, cores: int) -> list[ProfileRow]:
    import multiprocessing

    grid, size, rows = ctx.grid, min(ctx.grid.sizes), 2
    log(f"[host_probe] {size}px rows {rows}: alone and with up to {cores - 1} copies beside it, interleaved")
    forward = probe_forward(ctx.family, size, rows)
    mp = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    stop, ready = mp.Event(), mp.Queue()
    switches = [mp.Event() for _ in range(cores - 1)]
    siblings = [mp.Process(target=_probe_sibling, args=(source, threads, size, rows, sw, stop, ready), daemon=True)
                for sw in switches]
    for proc in siblings:
        proc.start()
    try:
        for _ in siblings:
            ready.get(timeout=300)
        times: dict[int, list[float]] = {k: [] for k in range(1, cores + 1)}
        batch = 20  # forwards per sample: long enough that the siblings are mid-forward
        for _ in range(grid.warmup + PROBE_ROUNDS):
            for copies in times:
                for i, switch in enumerate(switches):
                    if i < copies - 1:
                        switch.set()
                    else:
                        switch.clear()
                time.sleep(0.05)  # let the siblings get going (or stop)
                times[copies].append(ctx.watch.time(lambda: [forward() for _ in range(batch)]) / batch)
    finally:
        stop.set()
        for switch in switches:
            switch.set()
        for proc in siblings:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    # The VM's speed drifts within seconds; a ratio taken within each round (alone, then with
    # copies, back to back) cancels the drift that separate medians would keep.
    alone = times[1][grid.warmup:]
    out = []
    for copies, samples in times.items():
        ratio = statistics.median(t / a for t, a in zip(samples[grid.warmup:], alone))
        value = statistics.median(alone) * ratio
        log(f"  {copies} busy: {value * 1e3:.3f} ms ({ratio:.2f}x alone)")
        out.append(ctx.row(HOST_PROBE, value, PROBE_ROUNDS, size, size, copies,
                           f"family.denoise {size}px rows {rows} with {copies - 1} copies in sibling processes, "
                           f"{threads} thread(s) each"))
    return out


def measure_round_bookkeeping(ctx: Context, threads: int) -> list[ProfileRow]:
    from stepserve.engine.sampler import Conditioning
    from stepserve.engine.step_runner import Admission, StepRunner
    from stepserve.engine.text_encoding import encode_conditioning
    from stepserve.policies.types import RequestSpec, StepGroup, WorkerPlan

    family, grid, watch = ctx.family, ctx.grid, ctx.watch
    log(f"[round_overhead] StepRunner.execute minus its forwards: sizes {list(grid.sizes)}, "
        f"batches {list(grid.overhead_batches)}, CFG off/on")
    steps = grid.warmup + grid.repeats + 2  # nobody finishes while measured
    size = min(grid.sizes)
    cfg_on = family.classifier_free_guidance
    fox = encode_conditioning(family, RequestSpec("fox", ctx.model, PROMPT, size, size, steps, 7.5, 0, cfg=cfg_on))
    text = {True: fox, False: Conditioning(fox.prompt)}  # by CFG
    out = []
    admission = []
    for size in grid.sizes:
        for batch in grid.overhead_batches:
            for cfg in (False, True) if cfg_on else (False,):  # guidance-distilled models have one row
                timed = TimedFamily(family, watch)
                runner = StepRunner("profile", {ctx.model: timed})
                admissions = {}
                for i in range(batch):
                    spec = RequestSpec(f"r{i}", ctx.model, PROMPT, size, size, steps, 7.5 if cfg else 1.0, i,
                                       cfg=cfg_on)
                    admissions[spec.request_id] = Admission(spec, text[cfg])
                ids = tuple(admissions)
                admission.append(watch.time(lambda: runner.execute(WorkerPlan("profile", admit=ids), admissions))
                                 / batch)
                plan = WorkerPlan("profile", groups=(StepGroup(ids),))
                overheads = []
                for i in range(grid.warmup + grid.repeats):
                    timed.denoise_s = 0.0
                    total = watch.time(lambda: runner.execute(plan, {}))
                    if i >= grid.warmup:
                        overheads.append(total - timed.denoise_s)
                value = statistics.median(overheads)
                rows = batch * (2 if cfg else 1)
                log(f"  {size}px batch {batch} cfg {'on' if cfg else 'off'} (rows {rows}): {value * 1e3:.3f} ms")
                out.append(ctx.row(ROUND_OVERHEAD, value, len(overheads), size, size, rows,
                                   f"StepRunner.execute minus family.denoise, batch {batch} cfg "
                                   f"{'on' if cfg else 'off'}, {threads} thread(s)"))
    log(f"  (admission, per request: median {statistics.median(admission) * 1e3:.2f} ms; "
        "paid once, inside request_overhead when measured live)")
    return out


def measure_text_encode(ctx: Context, threads: int) -> list[ProfileRow]:
    grid = ctx.grid
    log(f"[text_encode] texts {list(grid.texts)}, {threads} thread(s)")
    cases = {n: (lambda n=n: ctx.family.encode_text([f"prompt number {i}, a red fox" for i in range(n)]))
             for n in grid.texts}
    medians = interleaved_medians(cases, ctx.watch, grid.warmup, grid.repeats, lambda n: f"{n} text(s)")
    return [ctx.row(TEXT_ENCODE, v, grid.repeats, rows=n, note=f"family.encode_text, {threads} thread(s)")
            for n, v in medians.items()]


def image_model_work(family, size: int, texts: int) -> Callable[[], Any]:
    """What one image request's text encoding and decode do (`texts` prompts; decode + PNG)."""
    from stepserve.engine.png import encode_png

    side = size // family.vae_scale_factor
    latents = torch.randn(1, family.latent_channels, side, side, generator=torch.Generator("cpu").manual_seed(1))
    return lambda: (family.encode_text([f"prompt number {i}, a red fox" for i in range(texts)]),
                    encode_png(family.decode(latents)[0]))


def measure_vae_decode(ctx: Context, threads: int) -> list[ProfileRow]:
    from stepserve.engine.png import encode_png

    family, grid = ctx.family, ctx.grid
    log(f"[vae_decode] decode + PNG, sizes {list(grid.sizes)}, {threads} thread(s)")
    generator = torch.Generator("cpu").manual_seed(1)
    cases = {}
    for size in grid.sizes:
        side = size // family.vae_scale_factor
        latents = torch.randn(1, family.latent_channels, side, side, generator=generator)
        cases[size] = (lambda lat=latents: encode_png(family.decode(lat)[0]))
    medians = interleaved_medians(cases, ctx.watch, grid.warmup, grid.repeats, lambda s: f"{s}px")
    return [ctx.row(VAE_DECODE, v, grid.repeats, s, s, 1, f"family.decode + encode_png, {threads} thread(s)")
            for s, v in medians.items()]


# -- the command -----------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    from stepserve.engine.families import resolve_device
    from stepserve.deployments.config import AppConfig
    from stepserve.engine.families import ALL_PARTS, load_family

    started = time.perf_counter()
    serve_config = load_serve_config(args.config)
    app = AppConfig.model_validate(serve_config["applications"][0].get("args", {}))
    model_config = app.model(args.model)
    if model_config is None:
        print(f"error: model {args.model!r} is not in {args.config}; it has {[m.name for m in app.models]}",
              file=sys.stderr)
        return 2
    if model_config.is_video:  # frames and sequence parallelism: its own grid (profiling/video.py)
        from stepserve.profiling.video import run_video_profile

        return run_video_profile(args, serve_config, app, model_config)
    device = resolve_device(args.device)
    out = Path(args.out) if args.out else CONFIGS / "profiles" / f"{model_config.name}-{device.split(':')[0]}.csv"
    try:
        grid = choose_grid(args, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    live = (not args.quick) if args.live is None else args.live

    torch.manual_seed(0)
    family = load_family(model_config.to_source(), ALL_PARTS, device)
    watch = Stopwatch(device)
    worker_threads = set_threads(app.workers.torch_threads)
    today = dt.date.today().isoformat()
    ctx = Context(model_config.name, device.split(":")[0], family, grid, watch,
                  f"measured {today} {device_description(device)}")
    log(f"profiling {model_config.name} on {device} ({'quick' if args.quick else 'full'} grid) -> {out}")

    rows = measure_denoise(ctx, worker_threads)
    rows += measure_addons(ctx, app, worker_threads)
    rows += measure_masked(ctx, app.edit_cache.cache, worker_threads)
    rows += measure_edit_blocks(ctx, worker_threads)
    rows += measure_packed(ctx, worker_threads)
    rows += measure_round_bookkeeping(ctx, worker_threads)
    # Where prompts encode and images decode: on the workers (`text_encoder.on_workers`,
    # `vae_decoder.on_workers`), with their threads.
    encoder = app.workers if app.text_encoder.on_workers else app.text_encoder
    rows += measure_text_encode(ctx, set_threads(encoder.torch_threads))
    decoder = app.workers if app.vae_decoder.on_workers else app.vae_decoder
    rows += measure_vae_decode(ctx, set_threads(decoder.torch_threads))
    set_threads(app.workers.torch_threads)
    cores = os.cpu_count() or 1
    probe = (not args.quick) if args.host_probe is None else args.host_probe
    if probe and not device.startswith("cuda") and cores > 1:
        rows += measure_host_probe(ctx, model_config.to_source(), worker_threads, cores)

    # The live requests guide by CFG (2 rows, 2 texts) unless the model is guidance-distilled.
    cfg = ctx.family.classifier_free_guidance
    request_rows, guided = (2, "CFG") if cfg else (1, "one guided row")
    echo, live_result = measure_on_ray(ctx, args.num_cpus, app.workers.max_batch_size, None if not live else (
        lambda: measure_live(ctx, serve_config, min(grid.sizes), what=guided,
                             model_work=image_model_work(ctx.family, min(grid.sizes), request_rows))))
    if live_result is None:
        rows += [echo] if echo is not None else []
    else:
        size = live_result.size
        in_process = ProfiledCostModel(rows).round_seconds([BatchShape(model_config.name, size, size, request_rows)])
        text = next(r for r in rows if r.component == TEXT_ENCODE and r.rows == request_rows).seconds
        decode = next(r for r in rows if r.component == VAE_DECODE and r.height == size).seconds
        rows += live_rows(ctx, live_result, in_process, text + decode, echo, f"{size}px {guided}")

    out.parent.mkdir(parents=True, exist_ok=True)
    write_profile(out, rows)
    model = ProfiledCostModel.from_csv(out)
    log(f"wrote {len(rows)} rows to {out} in {time.perf_counter() - started:.0f} s")
    print(format_fit_report(model.fit_report()))
    if model.masked_rows:
        print(masked_fit_report(ctx, app.edit_cache.cache, model.masked_rows))
    if model.packed_rows:
        print(packed_fit_report(model, grid.sizes))
    if live_result is not None:
        size, hi = live_result.size, live_result.steps[1]
        batch = BatchShape(model_config.name, size, size, request_rows)
        predicted, measured = model.round_seconds([batch]), live_result.per_step_s
        print(f"live check ({size}px, {guided}): per step {measured * 1e3:.2f} ms live vs {predicted * 1e3:.2f} ms "
              f"from the profile ({(predicted - measured) / measured:+.1%})")
        if live_result.worker_step_s is not None:
            fixed_s = model.fit_report()[model_config.name]["round_fixed_ms"] / 1e3
            in_process = model.round_seconds([batch]) - fixed_s
            print(f"  of which the worker's execute: {live_result.worker_step_s * 1e3:.2f} ms live vs "
                  f"{in_process * 1e3:.2f} ms in-process")
        solo, live_solo = model.solo_seconds(model_config.name, size, size, hi, cfg), live_result.medians_s[1]
        print(f"live check ({size}px, {guided}, {hi} steps): solo {live_solo * 1e3:.1f} ms live vs {solo * 1e3:.1f} ms "
              f"from the profile ({(solo - live_solo) / live_solo:+.1%})")
    return 0
