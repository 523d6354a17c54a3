"""`stepserve profile`: measure, on this device, the latencies a cost model is fitted from.

What is measured, each the median of interleaved repeats after a warm-up:

- denoise: one `family.denoise` forward per (resolution, batch rows); CFG on and off are covered
  by the rows they produce (a CFG request is 2 rows, so both settings meet at even rows, which
  are measured once).
- denoise with mask_ratio < 1 (where the family edits with cached activations): the forward the
  workers serve for a batch of edits of templates they hold a record of, at the grid's mask
  ratios, per resolution and number of edits (`masked_batches`); see profile_edits.py.
- denoise of several resolutions (where the family runs them in one forward): that forward for
  every mix of the grid's sizes, with `packed_batches` requests of each, timed beside the same
  groups run in turn; see profile_packed.py.
- round_overhead, per group: `StepRunner.execute(plan)` wall time minus the time spent inside
  `family.denoise` during that very call (the family is wrapped to time its forwards), i.e.
  the sampler bookkeeping a round adds around the forward.
- round_overhead, fixed: what the live loop adds around a worker round (the live per-step
  latency minus the in-process round: the forward and the bookkeeping above); without the live
  app, a bare Ray actor round trip carrying a `WorkerPlan` for a full batch and answering a
  `StepReport`, as the router does with a worker every round.
- text_encode: `family.encode_text` for 1, 2, 4, ... texts.
- vae_decode: `family.decode` of one latent plus `encode_png`, per resolution.
- host_probe (CPU only): one fixed forward (the smallest size, one CFG request) timed alone and
  with 1, 2, ... copies running beside it in sibling processes, up to one per core, the
  modes interleaved: how much busy cores slow each other on this host (shared caches, memory
  bandwidth, a VM's hyperthread-sibling vCPUs). The simulator charges it when the whole app
  shares one CPU box.
- request_overhead (unless --no-live): the config's real app on a lean local Ray, solo HTTP
  requests with two step counts; the latency line's intercept minus the measured text-encode
  and decode is what a request pays beyond its model work (HTTP, Serve and Ray hops, the
  text-encoder batch wait, admission).
- host_idle and router_cpu (with the live requests, where /proc shows the app's processes): the
  CPU this whole machine burns per second while the warm app sits idle (IDLE_S seconds), and
  the router process's CPU per denoising step (the slope of its CPU per solo request over the
  two step counts). Neither is on a request's path; the simulator charges both to a shared CPU
  host, where they take cores from the workers.

Threads follow the config: the denoiser with `workers.torch_threads`, the encoder and decoder
with their own, so the numbers are what each deployment would see.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stepserve.host_cpu import machine_busy_s, process_cpu_s, ray_process_cpu
from stepserve.policies.cost_model import (
    DENOISE,
    HOST_IDLE,
    HOST_PROBE,
    REQUEST_OVERHEAD,
    ROUND_OVERHEAD,
    ROUTER_CPU,
    TEXT_ENCODE,
    VAE_DECODE,
    BatchShape,
    ProfiledCostModel,
    ProfileRow,
    format_fit_report,
    write_profile,
)
from stepserve.runtime import CONFIGS, load_serve_config


@dataclass(frozen=True)
class ProfileGrid:
    sizes: tuple[int, ...]  # square sides, px
    batches: tuple[int, ...]  # requests per forward
    texts: tuple[int, ...]  # strings per text-encoder call
    overhead_batches: tuple[int, ...]  # batches whose round bookkeeping is measured
    warmup: int = 1
    repeats: int = 7
    rpc_repeats: int = 200
    live_steps: tuple[int, int] = (1, 11)
    live_repeats: int = 5
    # Masked forwards (profile_edits.py): edits per forward (CFG's 2 rows each where the model
    # guides by CFG), at every size, and the mask ratios they compute (none: not measured).
    masked_batches: tuple[int, ...] = (1, 4, 8)
    mask_ratios: tuple[float, ...] = (0.1, 0.2, 0.5)
    # Packed forwards (profile_packed.py): requests of each size in every mix of the grid's sizes.
    packed_batches: tuple[int, ...] = (1, 2, 4)

    def __post_init__(self) -> None:
        if not all(0.0 < m < 1.0 for m in self.mask_ratios):
            raise ValueError(f"mask ratios must be in (0, 1), got {list(self.mask_ratios)}")

    @property
    def rows(self) -> tuple[int, ...]:
        """Batch rows of every forward the grid asks for: b without CFG, 2b with it."""
        return tuple(sorted({b for b in self.batches} | {2 * b for b in self.batches}))


GRIDS = {
    # 15 pairs of live solo requests (about 5 s on the CPU VM): their medians set the round and
    # request overheads, and 5 let one slow second of the VM move them by tens of percent.
    "cpu": ProfileGrid(sizes=(64, 128, 256), batches=tuple(range(1, 9)), texts=(1, 2, 4, 8, 16),
                       overhead_batches=(1, 4, 8), live_repeats=15),
    "cuda": ProfileGrid(sizes=(512, 768, 1024), batches=tuple(range(1, 17)), texts=(1, 2, 4, 8, 16, 32),
                        overhead_batches=(1, 8, 16), warmup=2, repeats=10, live_repeats=15),
}
QUICK = ProfileGrid(sizes=(64,), batches=(1, 2), texts=(1, 2), overhead_batches=(1, 2), warmup=1, repeats=3,
                    rpc_repeats=50, live_repeats=3, masked_batches=(1, 2))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({os.cpu_count()} cores), torch {torch.__version__}"


class Stopwatch:
    """Wall time of a call; on CUDA it synchronizes first and after, so queued kernels count."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def interleaved_times(cases: dict[Any, Callable[[], Any]], watch: Stopwatch, warmup: int,
                      repeats: int) -> dict[Any, list[float]]:
    """Warm every case, then time them round-robin `repeats` times: drift on a shared machine
    then hits every case alike instead of whichever happened to run during it."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[Any, list[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key, fn in cases.items():
            times[key].append(watch.time(fn))
    return times


def interleaved_medians(cases: dict[Any, Callable[[], Any]], watch: Stopwatch, warmup: int, repeats: int,
                        label: Callable[[Any], str]) -> dict[Any, float]:
    """`interleaved_times`' median per case, logged."""
    medians = {key: statistics.median(ts) for key, ts in interleaved_times(cases, watch, warmup, repeats).items()}
    for key, value in medians.items():
        log(f"  {label(key)}: {value * 1e3:.3f} ms")
    return medians


DEFAULT_THREADS = torch.get_num_threads()


def set_threads(threads: int | None) -> int:
    """A component's configured thread count, or torch's default when it sets none."""
    torch.set_num_threads(threads or DEFAULT_THREADS)
    return torch.get_num_threads()


@dataclass
class Context:
    model: str
    device: str
    family: Any
    grid: ProfileGrid
    watch: Stopwatch
    source: str  # "measured <date>"

    def row(self, component: str, latency_s: float, samples: int, height: int = 0, width: int = 0, rows: int = 1,
            note: str = "", frames: int = 1, sp_degree: int = 1, mask_ratio: float = 1.0,
            groups: tuple[tuple[int, int, int], ...] = ()) -> ProfileRow:
        return ProfileRow(self.model, self.device, component, height, width, rows, frames, latency_s * 1e3, samples,
                          f"{self.source}; {note}" if note else self.source, sp_degree, mask_ratio, groups)


# -- the model's own work --------------------------------------------------------------------


PROMPT = "a photograph of a red fox in the snow"  # what the component timings condition on


def first_timestep(family, size: int = 64) -> torch.Tensor:
    """The first of 20 timesteps, set as a request's are (flow-matching families shift them by size)."""
    from stepserve.policies.types import RequestSpec

    spec = RequestSpec("t", family.source.name, PROMPT, size, size, 20, 1.0, 0, kind=family.kind)
    scheduler = family.make_scheduler()
    family.prepare_scheduler(scheduler, spec)
    return scheduler.timesteps[0]


def forward_inputs(family, text, t: torch.Tensor, rows: int, size: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A forward's random latents, timesteps and text conditioning for `rows` rows at `size` px."""
    from stepserve.engine.text_encoding import conditioning_rows

    side = size // family.vae_scale_factor
    sample = torch.randn(rows, family.latent_channels, side, side, generator=generator)
    sample = sample.to(device=family.device, dtype=family.dtype)
    return sample, t.reshape(1).expand(rows), conditioning_rows(family, text, rows, size, size)


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


IDLE_S = 5.0  # seconds the warm live app is left alone to read the host's idle CPU
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


# -- Ray and the live app --------------------------------------------------------------------


class EchoWorker:
    """Answers a plan the way a denoiser worker does, without doing the work."""

    def execute(self, plan, admissions):
        from stepserve.policies.types import RequestProgress, StepReport

        progress = tuple(RequestProgress(rid, 1, 20) for rid in plan.stepping)
        return StepReport(worker_id=plan.worker_id, plan_id=plan.plan_id, progress=progress, duration_s=0.0,
                          batch_size=len(plan.stepping))


def measure_rpc(ctx: Context, batch: int) -> ProfileRow:
    import ray

    from stepserve.policies.types import StepGroup, WorkerPlan

    grid = ctx.grid
    log(f"[round_overhead] Ray actor round trip, plan of {batch} requests, {grid.rpc_repeats} repeats")
    actor = ray.remote(EchoWorker).options(num_cpus=0, max_concurrency=1).remote()
    plan = WorkerPlan("w0", groups=(StepGroup(tuple(f"img-{i:032x}" for i in range(batch))),))
    try:
        for _ in range(max(10, grid.warmup)):
            ray.get(actor.execute.remote(plan, ()))
        times = [ctx.watch.time(lambda: ray.get(actor.execute.remote(plan, ()))) for _ in range(grid.rpc_repeats)]
    finally:
        ray.kill(actor)
    value = statistics.median(times)
    log(f"  round trip: {value * 1e3:.3f} ms")
    return ctx.row(ROUND_OVERHEAD, value, len(times), note=f"Ray actor round trip, WorkerPlan of {batch}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LiveResult:
    size: int
    steps: tuple[int, int]
    medians_s: tuple[float, float]
    samples: int
    # The workers' `execute` time per step of the measured requests (router metrics: all plans'
    # execute seconds over the steps the requests ran; a steady plan runs several steps).
    worker_step_s: float | None
    # What else takes CPU on this host (None where /proc does not show the app's processes):
    # cores the whole machine keeps busy while the app is idle, and the router process's median
    # CPU seconds over one solo request at each of the two step counts.
    idle_cores: float | None = None
    router_cpu_medians_s: tuple[float, float] | None = None
    # The median time of the model work a request does once (text encoding, decode), timed in
    # this process after every measured pair: in the same seconds as the live intercept it is
    # taken from, on a VM whose speed moves within them (None: not timed there).
    model_work_s: float | None = None

    @property
    def per_step_s(self) -> float:
        (lo, hi), (l_lo, l_hi) = self.steps, self.medians_s
        return (l_hi - l_lo) / (hi - lo)

    @property
    def intercept_s(self) -> float:
        return self.medians_s[0] - self.steps[0] * self.per_step_s

    @property
    def step_residual_s(self) -> float | None:
        """Per step, what the live loop adds around the worker's own execute: the router's
        plan and bookkeeping and the Ray round trip where pipelining does not hide them."""
        return None if self.worker_step_s is None else self.per_step_s - self.worker_step_s

    @property
    def router_step_cpu_s(self) -> float | None:
        """The router's CPU per denoising step: the slope of its per-request CPU over the two
        step counts (its per-request work, submit to response, is in the intercept and so in
        request_overhead). A plan per step (GenServe) costs a decision per step; a steady plan
        of many steps next to nothing (never below 0: noise)."""
        if self.router_cpu_medians_s is None:
            return None
        (lo, hi), (c_lo, c_hi) = self.steps, self.router_cpu_medians_s
        return max(0.0, (c_hi - c_lo) / (hi - lo))


def round_totals(metrics_text: str) -> tuple[float, float]:
    """(sum, count) of the router's per-round worker execute times, over all workers."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("stepserve_step_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("stepserve_step_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def send_image(client, model: str, size: int, steps: int, i: int) -> None:
    """One image request, answered when it is done (guidance 7.5: CFG on where the model guides by
    CFG; a prompt never seen before)."""
    body = {"model": model, "prompt": f"profile request {i}-{steps}: a red fox",
            "negative_prompt": f"blurry {i}-{steps}", "size": f"{size}x{size}",
            "num_inference_steps": steps, "guidance_scale": 7.5, "seed": i}
    response = client.post("/v1/images/generations", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"live request failed ({response.status_code}): {response.text[:300]}")


def measure_live(ctx: Context, serve_config: dict, size: int, send: Callable = send_image,
                 what: str = "CFG", model_work: Callable[[], Any] | None = None) -> LiveResult:
    """Solo requests through the config's real app: HTTP → ingress → router → text encoder,
    worker rounds, VAE decoder. Each prompt is new, so the encoder's cache never answers.
    `send(client, model, size, steps, i)` makes one request and returns once it is done;
    `model_work()`, the request's one-off model work in this process, is timed after each pair."""
    import httpx
    from ray import serve

    from stepserve.runtime import run_app

    grid = ctx.grid
    config = copy.deepcopy(serve_config)
    port = free_port()
    config["http_options"] = {**(config.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    url = f"http://127.0.0.1:{port}"
    log(f"[request_overhead] deploying the config's app on {url} ...")
    run_app(config, http=True)
    lo, hi = grid.live_steps
    latencies: dict[int, list[float]] = {lo: [], hi: []}
    router = f"ray::ServeReplica:{config['applications'][0].get('name', 'stepserve')}:Router"
    router_cpu: dict[int, list[float]] = {lo: [], hi: []}
    work: list[float] = []
    try:
        with httpx.Client(base_url=url, timeout=300.0, trust_env=False) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get("/ready", timeout=5.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url}/ready never answered 200")
                time.sleep(0.5)
            log(f"  solo requests {size}x{size}, {what}, steps {lo} and {hi}, {grid.live_repeats} each")
            before, idle_cores, router_pid = (0.0, 0.0), None, None
            for i in range(1 + grid.live_repeats):  # the first pair warms every replica
                if i == 1:
                    idle_cores = measure_idle_cores()
                    before = round_totals(client.get("/metrics").text)
                    router_pid = next((pid for pid, (title, _) in ray_process_cpu().items() if title == router), None)
                for steps in ((lo, hi) if i % 2 else (hi, lo)):
                    cpu_before, start = process_cpu_s(router_pid) if router_pid else None, time.perf_counter()
                    send(client, ctx.model, size, steps, i)
                    if i:
                        latencies[steps].append(time.perf_counter() - start)
                        cpu_after = process_cpu_s(router_pid) if router_pid else None
                        if cpu_before is not None and cpu_after is not None:
                            router_cpu[steps].append(cpu_after - cpu_before)
                if i and model_work is not None:
                    work.append(ctx.watch.time(model_work))
            after = round_totals(client.get("/metrics").text)
    finally:
        serve.delete(config["applications"][0].get("name", "stepserve"))
    medians = (statistics.median(latencies[lo]), statistics.median(latencies[hi]))
    rounds = after[1] - before[1]
    steps_run = grid.live_repeats * (lo + hi)
    worker_step = (after[0] - before[0]) / steps_run if rounds else None
    router_seen = bool(router_cpu[lo] and router_cpu[hi])  # /proc shows the app: it runs on this host
    result = LiveResult(size, (lo, hi), medians, grid.live_repeats, worker_step, idle_cores if router_seen else None,
                        (statistics.median(router_cpu[lo]), statistics.median(router_cpu[hi])) if router_seen else None,
                        statistics.median(work) if work else None)
    log(f"  median latency: {lo} step(s) {medians[0] * 1e3:.1f} ms, {hi} steps {medians[1] * 1e3:.1f} ms; "
        f"per step {result.per_step_s * 1e3:.2f} ms, intercept {result.intercept_s * 1e3:.1f} ms")
    if worker_step is not None:
        log(f"  worker execute per step (router metrics, {steps_run} steps in {rounds:.0f} plans): "
            f"{worker_step * 1e3:.2f} ms; the live loop adds {result.step_residual_s * 1e3:.2f} ms per step around it")
    if result.router_cpu_medians_s is not None:
        c_lo, c_hi = result.router_cpu_medians_s
        log(f"  host: {idle_cores:.3f} cores busy with the app idle; router CPU a request {c_lo * 1e3:.1f} ms "
            f"({lo} step(s)), {c_hi * 1e3:.1f} ms ({hi} steps): {result.router_step_cpu_s * 1e3:.2f} ms a step")
    return result


def measure_idle_cores(seconds: float = IDLE_S) -> float:
    """Cores this whole machine keeps busy over `seconds` while the app (deployed, warm) and
    this process wait: the Serve controller, proxy and replicas, Ray's daemons, the OS."""
    busy, started = machine_busy_s(), time.monotonic()
    time.sleep(seconds)
    return (machine_busy_s() - busy) / (time.monotonic() - started)


def live_rows(ctx: Context, live: LiveResult, in_process_step_s: float, model_work_s: float, echo: ProfileRow,
              what: str) -> list[ProfileRow]:
    """The fixed round overhead and the request overhead from solo live requests.

    Per round: what a live step costs beyond the in-process one (forward + bookkeeping) is what
    the simulator must charge, namely the Ray round trip where pipelining does not hide it and
    the worker's own cost around the round (arguments, object refs, outputs); the bare round
    trip (`echo`) when that reads as nothing. Not "minus the worker's execute": with pipelined
    plans a step is shorter than an execute. Per request: the latency line's intercept minus
    the model work a request does once (text encoding and decoding): as timed between the live
    pairs when it was (`LiveResult.model_work_s`), else `model_work_s` (the profile's rows)."""
    residual = live.per_step_s - in_process_step_s
    rows = [ctx.row(ROUND_OVERHEAD, residual, live.samples,
                    note=f"live app: per-step latency minus the in-process step ({what} solo); "
                         f"bare Ray round trip {echo.latency_ms:.3f} ms")
            if residual > 0 else echo]
    timed_between = live.model_work_s is not None
    overhead = live.intercept_s - (live.model_work_s if timed_between else model_work_s)
    if overhead < 0:
        log(f"  warning: intercept below encode + decode by {-overhead * 1e3:.1f} ms (noise); recording 0")
    lo, hi = live.steps
    rows.append(ctx.row(REQUEST_OVERHEAD, max(0.0, overhead), live.samples,
                        note=f"live app over HTTP, solo {what} requests at {lo} and {hi} steps: "
                             "latency intercept minus its text encoding and decode"
                             + (" (timed in-process between the live pairs)" if timed_between else "")))
    if live.idle_cores is not None:
        rows.append(ctx.row(HOST_IDLE, live.idle_cores, 1,
                            note=f"CPU ms per wall second of the whole machine, live app idle for {IDLE_S:g} s"))
    if live.router_step_cpu_s is not None:
        rows.append(ctx.row(ROUTER_CPU, live.router_step_cpu_s, live.samples,
                            note=f"router process CPU per step: slope over solo {what} requests at {lo} and {hi} "
                                 "steps"))
    return rows


# -- the command -----------------------------------------------------------------------------


def choose_grid(args: argparse.Namespace, device: str) -> ProfileGrid:
    grid = QUICK if args.quick else GRIDS["cuda" if device.startswith("cuda") else "cpu"]
    changes = {}
    if args.sizes:
        changes["sizes"] = tuple(args.sizes)
    if args.batches:
        changes["batches"] = tuple(args.batches)
    if args.repeats:
        changes["repeats"] = args.repeats
    if args.mask_ratios is not None:
        changes["mask_ratios"] = tuple(args.mask_ratios)
    return grid if not changes else ProfileGrid(**{**grid.__dict__, **changes})


def run_profile(args: argparse.Namespace) -> int:
    import ray

    from stepserve.actors.denoiser import resolve_device
    from stepserve.deployments.config import AppConfig
    from stepserve.engine.families import ALL_PARTS, load_family
    from stepserve.profile_addons import measure_addons
    from stepserve.profile_edits import masked_fit_report, measure_masked
    from stepserve.profile_packed import measure_packed, packed_fit_report
    from stepserve.runtime import start_local_ray

    started = time.perf_counter()
    serve_config = load_serve_config(args.config)
    app = AppConfig.model_validate(serve_config["applications"][0].get("args", {}))
    model_config = app.model(args.model)
    if model_config is None:
        print(f"error: model {args.model!r} is not in {args.config}; it has {[m.name for m in app.models]}",
              file=sys.stderr)
        return 2
    if model_config.is_video:  # frames and sequence parallelism: its own grid (profile_video.py)
        from stepserve.profile_video import run_video_profile

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
    live_result = None
    start_local_ray(args.num_cpus)
    try:
        echo = measure_rpc(ctx, app.workers.max_batch_size)
        if live:
            live_result = measure_live(ctx, serve_config, min(grid.sizes), what=guided,
                                       model_work=image_model_work(ctx.family, min(grid.sizes), request_rows))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()

    if live_result is None:
        rows.append(echo)
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
        print(packed_fit_report(model))
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
