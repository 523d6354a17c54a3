"""`stepserve profile`'s Ray and live-app measurements: a bare actor round trip carrying a plan,
the config's real app over HTTP, the idle host, and the rows derived from them."""

from __future__ import annotations

import copy
import importlib.util
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


from stepserve.host_cpu import machine_busy_s, process_cpu_s, ray_process_cpu
from stepserve.policies.cost_model import (
    HOST_IDLE,
    REQUEST_OVERHEAD,
    ROUND_OVERHEAD,
    ROUTER_CPU,
    ProfileRow,
)
from stepserve.profiling.common import Context, log


# -- Ray and the live app --------------------------------------------------------------------


IDLE_S = 5.0  # seconds the warm live app is left alone to read the host's idle CPU


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


def measure_on_ray(ctx: Context, num_cpus: int | None, batch: int,
                   live: Callable[[], LiveResult] | None) -> tuple[ProfileRow | None, LiveResult | None]:
    """On a lean local Ray started here and shut down after: the actor round trip of a plan of
    `batch` requests (`measure_rpc`), and `live()` (a `measure_live` call) unless it is None.

    Without Ray installed (a bare GPU machine profiling the model's own work), no round trip: the
    profile then has no fixed round row, which the cost model reads as 0; the live measurements
    need Ray and are refused."""
    if importlib.util.find_spec("ray") is None:
        if live is not None:
            raise RuntimeError("the live measurements need Ray, which is not installed here: pass --no-live")
        log("[round_overhead] Ray is not installed here: the actor round trip is not measured (read as 0)")
        return None, None
    import ray
    from ray import serve

    from stepserve.runtime import start_local_ray

    start_local_ray(num_cpus)
    try:
        return measure_rpc(ctx, batch), None if live is None else live()
    finally:
        serve.shutdown()
        ray.shutdown()


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
        if line.startswith("stepserve_worker_plan_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("stepserve_worker_plan_seconds_count"):
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
