"""`stepserve profile` for a video model (a family whose `kind` is t2v, i.e. Wan).

What is measured, each the median of interleaved repeats after a warm-up (the machinery of
`stepserve.profiling.images`):

- denoise: one `family.denoise` forward per (size, frames, rows); rows 1 and 2 are one video
  without and with CFG (a worker steps one video per forward). At SP degree 1 in this process;
  at each degree 2..min(max_degree, cores or GPUs) that the model's attention heads allow
  (`UlyssesLayout.plan`), in a group of that many fresh processes joined over gloo (NCCL on
  GPUs), where every rank runs the same `family.denoise(..., sp_group=group)`, as the SP
  members of a video do. Before each timed forward the ranks meet at a barrier; a repeat's
  latency is its slowest rank's time, and the row is the median of those.
- vae_decode: `family.decode(latents)` of one video per (size, frames), then the uint8
  conversion a worker's `StepRunner` does when it finishes a video. A video decodes on its
  worker (no PNG; the MP4 is written outside the step loop), so the worker's threads apply.
- text_encode: `family.encode_text` for 1, 2, 4 texts, with the text encoder's threads.
- round_overhead, fixed, and request_overhead (unless --no-live or --quick): the config's real
  app on a lean local Ray, solo video jobs at the largest (size, frames) with two step counts,
  each created and long-polled to its end; as for images (`stepserve.profiling.live.live_rows`), what
  a live step costs beyond the in-process SP-1 step, and the latency intercept minus text
  encoding and decoding. Without the live app, the fixed round overhead is a bare Ray actor
  round trip carrying a `WorkerPlan` of one request (`stepserve.profiling.live.measure_rpc`).

Not measured for videos: the per-group round bookkeeping (`Sampler.advance`; counted as 0) and
the host probe (the image profile of the same host has it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepserve.policies.cost_model import (
    DENOISE,
    TEXT_ENCODE,
    VAE_DECODE,
    ProfiledCostModel,
    ProfileRow,
    format_fit_report,
    write_profile,
)
from stepserve.profiling.common import (
    Context,
    Stopwatch,
    device_description,
    first_timestep,
    interleaved_medians,
    log,
    set_threads,
)
from stepserve.profiling.live import free_port, live_rows, measure_live, measure_on_ray
from stepserve.runtime import CONFIGS

PROMPT = "a red fox runs through the snow"
SP_TIMEOUT_S = 600  # a whole SP group's run; a hung collective must not hang the profiler


@dataclass(frozen=True)
class VideoProfileGrid:
    sizes: tuple[int, ...]  # square sides, px (rounded up to the family's `size_multiple`)
    frames: tuple[int, ...]  # frame counts (4k + 1, as the pipeline rounds them)
    texts: tuple[int, ...]  # strings per text-encoder call
    max_degree: int  # largest SP degree tried (further capped by cores or GPUs and heads)
    rows: tuple[int, ...] = (1, 2)  # one video, CFG off / on
    warmup: int = 1
    repeats: int = 7  # decode and text encode
    denoise_repeats: int = 31  # tiny forwards take milliseconds: more repeats, same wall time
    rpc_repeats: int = 200
    # Solo live jobs at these step counts give a latency line; far apart, as a tiny video step
    # (~4 ms on CPU) is small beside its decode (~190 ms), whose noise would swamp 10 steps.
    live_steps: tuple[int, int] = (1, 41)
    live_repeats: int = 5


GRIDS = {
    # 15 live pairs, as for images: a 1-step job's latency is mostly its decode, noisy on a VM.
    "cpu": VideoProfileGrid(sizes=(32, 48, 64), frames=(5, 9), texts=(1, 2, 4), max_degree=4, live_repeats=15),
    "cuda": VideoProfileGrid(sizes=(256, 384, 512), frames=(17, 49, 81), texts=(1, 2, 4), max_degree=8, warmup=2,
                             repeats=5, denoise_repeats=10),
}
QUICK = VideoProfileGrid(sizes=(32, 48), frames=(5,), texts=(1, 2), max_degree=2, repeats=3, denoise_repeats=5,
                         rpc_repeats=50, live_repeats=3)


def choose_grid(args: argparse.Namespace, device: str) -> VideoProfileGrid:
    grid = QUICK if args.quick else GRIDS["cuda" if device.startswith("cuda") else "cpu"]
    if args.sizes:
        grid = replace(grid, sizes=tuple(args.sizes))
    if args.repeats:
        grid = replace(grid, repeats=args.repeats, denoise_repeats=args.repeats)
    if args.batches:
        log("note: --batches is ignored for a video model (a forward steps one video: rows 1 and 2)")
    return grid


Point = tuple[int, int, int]  # (height, width, frames) as the pipeline generates them


def video_points(family, grid: VideoProfileGrid) -> list[Point]:
    points: list[Point] = []
    multiple = family.size_multiple  # 16 for Wan 2.1 and A14B, 32 for TI2V-5B
    sides = dict.fromkeys(-(-size // multiple) * multiple for size in grid.sizes)
    if tuple(sides) != grid.sizes:
        log(f"note: sides {list(grid.sizes)} run as {list(sides)} (multiples of {multiple})")
    for size in sides:
        for frames in grid.frames:
            point = family.video_shape(size, size, frames)  # rejects sizes the pipeline rejects
            if point != (size, size, frames):
                log(f"note: {size}px {frames} frames runs as {point[0]}px {point[2]} frames")
            if point not in points:
                points.append(point)
    return points


def tokens_of(family, point: Point) -> int:
    _, _, frames, height, width = family.latent_shape(*point)
    p_t, p_h, p_w = family.transformer.config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)


def sp_degrees(family, max_degree: int, available: int) -> list[int]:
    """Degrees 2.. that fit this host and that the model's heads can be split over."""
    from stepserve.engine.parallel.ulysses import UlyssesLayout

    heads = family.transformer.config.num_attention_heads
    degrees = []
    for degree in range(2, min(max_degree, available) + 1):
        try:
            UlyssesLayout.plan(num_tokens=degree, num_heads=heads, world_size=degree, rank=0)
        except ValueError as exc:
            log(f"note: SP degree {degree} skipped: {exc}")
            continue
        degrees.append(degree)
    return degrees


def denoise_cases(family, points: list[Point], rows: tuple[int, ...], text: dict[str, np.ndarray], t: torch.Tensor,
                  sp_group: Any = None) -> dict[tuple[int, int, int, int], Any]:
    """One forward per (height, width, frames, rows), conditioned on `text` (one prompt's
    embeddings); the inputs are the same in every process (one seeded generator), so the ranks
    of an SP group make the same call."""
    from stepserve.engine.text_encoding import conditioning_rows

    generator = torch.Generator("cpu").manual_seed(0)
    cases = {}
    for point in points:
        latent = family.latent_shape(*point)[1:]
        for r in rows:
            sample = torch.randn(r, *latent, generator=generator).to(family.device)
            timesteps = t.to(family.device).reshape(1).expand(r)
            cond = conditioning_rows(family, text, r, *point)
            cases[(*point, r)] = (lambda s=sample, ts=timesteps, c=cond:
                                  family.denoise(s, ts, c, sp_group=sp_group))
    return cases


def point_label(point: Point) -> str:
    height, width, frames = point
    return f"{height}x{width} {frames} frames"


def label(key: tuple[int, int, int, int]) -> str:
    return f"{point_label(key[:3])} rows {key[3]}"


# -- sequence-parallel ranks -----------------------------------------------------------------


def sp_rank(rank: int, world: int, port: int, backend: str, source, threads: int, points: list[Point],
            rows: tuple[int, ...], text, timestep, warmup: int, repeats: int, out_path: str) -> None:
    """One rank of an SP group: time every case, all ranks in step, and hand rank 0 the times."""
    from stepserve.engine.families import DENOISER, load_family

    torch.set_num_threads(threads)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=timedelta(seconds=SP_TIMEOUT_S))
    dist = torch.distributed
    try:
        group = dist.new_group(list(range(world)))  # passed explicitly, as a worker's SP group is
        family = load_family(source, {DENOISER}, device)
        cases = denoise_cases(family, points, rows, text, torch.from_numpy(timestep), group)
        watch = Stopwatch(device)
        times: dict[Any, list[float]] = {key: [] for key in cases}
        for i in range(warmup + repeats):
            for key, fn in cases.items():
                dist.barrier(group=group)  # every rank starts the forward together
                elapsed = watch.time(fn)
                if i >= warmup:
                    times[key].append(elapsed)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [times[key] for key in cases], group=group)
        if rank == 0:
            results = []
            for j, key in enumerate(cases):
                per_rank = [g[j] for g in gathered]
                slowest = [max(ts) for ts in zip(*per_rank)]
                results.append({"key": list(key), "median_s": statistics.median(slowest),
                                "rank_medians_s": [statistics.median(ts) for ts in per_rank]})
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


def run_sp_group(degree: int, source, threads: int, device: str, points: list[Point], rows: tuple[int, ...],
                 text: dict[str, np.ndarray], t: torch.Tensor, warmup: int,
                 repeats: int) -> dict[tuple, tuple[float, list]]:
    """Start `degree` ranks, wait for them (killing them past SP_TIMEOUT_S), and return
    {(h, w, frames, rows): (slowest-rank median, per-rank medians)}."""
    import multiprocessing

    import torch.multiprocessing as mp

    # A fork server that imported the engine once forks the ranks: spawning each would import
    # torch and diffusers per rank, and forking this process is unsafe once it has threads.
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__, "stepserve.engine.families"])
    backend = "nccl" if device.startswith("cuda") else "gloo"
    scratch = tempfile.mkdtemp(prefix="stepserve-sp-profile-")
    out_path = os.path.join(scratch, "rank0.json")
    try:
        procs = mp.start_processes(
            sp_rank, nprocs=degree, join=False, start_method="forkserver",
            args=(degree, free_port(), backend, source, threads, points, rows,
                  text, t.detach().cpu().numpy(), warmup, repeats,
                  out_path),
        )
        deadline = time.monotonic() + SP_TIMEOUT_S
        try:
            while not procs.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SP degree {degree} group did not finish within {SP_TIMEOUT_S} s")
        finally:
            for proc in procs.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
        with open(out_path) as f:
            results = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {tuple(r["key"]): (r["median_s"], r["rank_medians_s"]) for r in results}


# -- the components --------------------------------------------------------------------------


def measure_video_denoise(ctx: Context, source, threads: int, device: str, available: int) -> list[ProfileRow]:
    family, grid = ctx.family, ctx.grid
    points = video_points(family, grid)
    from stepserve.engine.text_encoding import embed

    text = embed(family, PROMPT)
    t = first_timestep(family)
    log(f"[denoise] SP 1: {len(points)} (size, frames) x rows {list(grid.rows)}, {threads} thread(s), in-process")
    medians = interleaved_medians(denoise_cases(family, points, grid.rows, text, t), ctx.watch, grid.warmup,
                                  grid.denoise_repeats, label)
    out = [ctx.row(DENOISE, v, grid.denoise_repeats, h, w, r, f"family.denoise, {threads} thread(s)", frames=f)
           for (h, w, f, r), v in medians.items()]
    for degree in sp_degrees(family, grid.max_degree, available):
        fit = [p for p in points if tokens_of(family, p) >= degree]
        for p in points:
            if p not in fit:
                log(f"note: {point_label(p)} has {tokens_of(family, p)} tokens, too few for SP degree {degree}")
        if not fit:
            continue
        log(f"[denoise] SP {degree}: {len(fit)} (size, frames) x rows {list(grid.rows)}, {degree} processes x "
            f"{threads} thread(s) over {'nccl' if device.startswith('cuda') else 'gloo'}")
        started = time.perf_counter()
        results = run_sp_group(degree, source, threads, device, fit, grid.rows, text, t, grid.warmup,
                               grid.denoise_repeats)
        for key, (value, per_rank) in results.items():
            spread = ", ".join(f"{m * 1e3:.3f}" for m in per_rank)
            log(f"  {label(key)} sp{degree}: {value * 1e3:.3f} ms (rank medians {spread} ms)")
            h, w, f, r = key
            out.append(ctx.row(DENOISE, value, grid.denoise_repeats, h, w, r,
                               f"family.denoise(sp_group) over {degree} processes x {threads} thread(s), "
                               "slowest rank per repeat", frames=f, sp_degree=degree))
        log(f"  (SP {degree} group: {time.perf_counter() - started:.1f} s including process start)")
    return out


def measure_video_decode(ctx: Context, threads: int) -> list[ProfileRow]:
    family, grid = ctx.family, ctx.grid
    points = video_points(family, grid)
    log(f"[vae_decode] decode + uint8, {len(points)} (size, frames), {threads} thread(s)")
    generator = torch.Generator("cpu").manual_seed(1)
    cases = {}
    for point in points:
        latents = torch.randn(*family.latent_shape(*point), generator=generator)
        # As a worker finishing a video (`StepRunner`): frames in [0, 1] to uint8.
        cases[point] = (lambda lat=latents: (family.decode(lat)[0] * 255).round().astype("uint8"))
    medians = interleaved_medians(cases, ctx.watch, grid.warmup, grid.repeats, point_label)
    return [ctx.row(VAE_DECODE, v, grid.repeats, h, w, 1, f"family.decode + uint8 (on the worker), {threads} thread(s)",
                    frames=f) for (h, w, f), v in medians.items()]


def video_model_work(family, point: Point) -> Callable[[], Any]:
    """What one video job's text encoding (a prompt and its negative) and decode do."""
    latents = torch.randn(*family.latent_shape(*point), generator=torch.Generator("cpu").manual_seed(1))
    return lambda: (family.encode_text([f"a prompt, {PROMPT}", "a negative prompt"]),
                    (family.decode(latents)[0] * 255).round().astype("uint8"))


def measure_video_text(ctx: Context, threads: int) -> list[ProfileRow]:
    grid = ctx.grid
    log(f"[text_encode] texts {list(grid.texts)}, {threads} thread(s)")
    cases = {n: (lambda n=n: ctx.family.encode_text([f"prompt number {i}, {PROMPT}" for i in range(n)]))
             for n in grid.texts}
    medians = interleaved_medians(cases, ctx.watch, grid.warmup, grid.repeats, lambda n: f"{n} text(s)")
    return [ctx.row(TEXT_ENCODE, v, grid.repeats, rows=n, note=f"family.encode_text, {threads} thread(s)")
            for n, v in medians.items()]


def send_video(frames: int):
    """A `measure_live` sender: one video job (CFG on, a prompt never seen before), created and
    long-polled (`Prefer: wait`) until it has completed."""

    def send(client, model: str, size: int, steps: int, i: int) -> None:
        body = {"model": model, "prompt": f"profile job {i}-{steps}: {PROMPT}", "negative_prompt": f"blurry {i}",
                "size": f"{size}x{size}", "num_frames": frames, "num_inference_steps": steps,
                "guidance_scale": 5.0, "seed": i}
        response = client.post("/v1/videos", json=body)
        while response.status_code == 200 and response.json()["status"] in ("queued", "in_progress"):
            response = client.get(f"/v1/videos/{response.json()['id']}", headers={"Prefer": "wait=60"})
        if response.status_code != 200 or response.json()["status"] != "completed":
            raise RuntimeError(f"live video job did not complete ({response.status_code}): {response.text[:300]}")

    return send


# -- the command -----------------------------------------------------------------------------


def run_video_profile(args: argparse.Namespace, serve_config: dict, app, model_config) -> int:
    """`stepserve profile` for a video model; `app` is `serve_config`'s validated `AppConfig`."""
    from stepserve.engine.families import resolve_device
    from stepserve.engine.families import ALL_PARTS, load_family

    started = time.perf_counter()
    device = resolve_device(args.device)
    out = Path(args.out) if args.out else CONFIGS / "profiles" / f"{model_config.name}-{device.split(':')[0]}.csv"
    grid = choose_grid(args, device)
    live = (not args.quick) if args.live is None else args.live
    if args.host_probe:
        log("note: --host-probe is not run for video models (the image profile of this host has it)")
    available = torch.cuda.device_count() if device.startswith("cuda") else (os.cpu_count() or 1)

    torch.manual_seed(0)
    source = model_config.to_source()
    family = load_family(source, ALL_PARTS, device)
    worker_threads = set_threads(app.workers.torch_threads)
    ctx = Context(model_config.name, device.split(":")[0], family, grid, Stopwatch(device),
                  f"measured {dt.date.today().isoformat()} {device_description(device)}")
    log(f"profiling video model {model_config.name} on {device} ({'quick' if args.quick else 'full'} grid) -> {out}")

    rows = measure_video_denoise(ctx, source, worker_threads, device, available)
    rows += measure_video_decode(ctx, worker_threads)
    encoder = app.workers if app.text_encoder.on_workers else app.text_encoder  # `text_encoder.on_workers`
    rows += measure_video_text(ctx, set_threads(encoder.torch_threads))
    set_threads(app.workers.torch_threads)

    h, w, f = max(video_points(family, grid))
    # (a video step names one video)
    echo, live_result = measure_on_ray(ctx, args.num_cpus, 1, None if not live else (
        lambda: measure_live(ctx, serve_config, h, send_video(f), what=f"{f}-frame CFG",
                             model_work=video_model_work(family, (h, w, f)))))
    if live_result is None:
        rows += [echo] if echo is not None else []
    else:
        in_process = ProfiledCostModel(rows).video_step_seconds(model_config.name, h, w, f, 1)
        text = next(r for r in rows if r.component == TEXT_ENCODE and r.rows == 2).seconds
        decode = next(r for r in rows if r.component == VAE_DECODE and (r.height, r.frames) == (h, f)).seconds
        rows += live_rows(ctx, live_result, in_process, text + decode, echo, f"{h}x{w} {f}-frame CFG")

    out.parent.mkdir(parents=True, exist_ok=True)
    write_profile(out, rows)
    model = ProfiledCostModel.from_csv(out)
    log(f"wrote {len(rows)} rows to {out} in {time.perf_counter() - started:.0f} s")
    print(format_fit_report(model.fit_report()))
    steps = ", ".join(f"SP {d}: {model.video_step_seconds(model_config.name, h, w, f, d) * 1e3:.2f} ms"
                      for d in model.sp_degrees(model_config.name))
    print(f"video step ({h}x{w}, {f} frames, CFG) from the profile: {steps}")
    return 0
