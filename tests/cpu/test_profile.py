"""`stepserve profile --quick` measures tiny-sd on this CPU and writes a CSV the cost model loads."""

import os
import subprocess
import sys
import time

import pytest

from stepserve.deployments.config import ModelConfig
from stepserve.policies.cost_model import (
    CFG_EXCHANGE,
    CONTROLNET,
    CONTROLNET_TRANSFER,
    DENOISE,
    DENOISE_ENCODER,
    LORA,
    LORA_LOAD,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    BatchShape,
    ProfiledCostModel,
    read_profile,
)


def test_quick_profile_writes_a_loadable_csv(tmp_path):
    out = tmp_path / "tiny-sd-cpu.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "stepserve.cli", "profile", "--config", "configs/local-tiny.yaml", "--model", "tiny-sd",
         "--device", "cpu", "--quick", "--out", str(out), "--num-cpus", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[denoise]" in proc.stderr and "wrote" in proc.stderr  # progress is printed

    rows = read_profile(out)
    assert {r.model for r in rows} == {"tiny-sd"} and {r.device for r in rows} == {"cpu"}
    by = lambda component: [r for r in rows if r.component == component]  # noqa: E731
    assert all(r.source.startswith("measured ") for r in rows)
    # Every row is a time, except a LoRA's: its extra over the plain forward, a difference of two
    # timings that a busy host can drive to 0 (measured clamps it there, never below).
    assert all(r.latency_ms > 0 for r in rows if r.component != LORA)
    assert all(r.latency_ms >= 0 for r in by(LORA)) and by(LORA)
    # Quick grid: 64 px, batches 1-2 with CFG off/on -> rows 1, 2, 4.
    assert sorted((r.height, r.rows) for r in by(DENOISE)) == [(64, 1), (64, 2), (64, 4)]
    assert sorted(r.rows for r in by(TEXT_ENCODE)) == [1, 2]
    assert [r.height for r in by(VAE_DECODE)] == [64]
    fixed = [r for r in by(ROUND_OVERHEAD) if r.height == 0]
    assert len(fixed) == 1 and "Ray actor round trip" in fixed[0].source
    assert len(by(ROUND_OVERHEAD)) > 1  # plus per-group bookkeeping

    model = ProfiledCostModel.from_csv(out)
    batch = BatchShape("tiny-sd", 64, 64, 2)
    assert model.round_seconds([batch]) > model.denoise_seconds(batch) > 0
    assert model.solo_seconds("tiny-sd", 64, 64, 10, True) > 10 * model.denoise_seconds(batch)
    report = model.fit_report()["tiny-sd"]
    assert report["missing"] == ["request_overhead"]  # --quick skips the live app
    # configs/local-tiny.yaml serves ControlNets and LoRAs for tiny-sd: their rows, on the same grid.
    for component in (CONTROLNET, DENOISE_ENCODER, LORA):
        assert sorted((r.height, r.rows) for r in by(component)) == [(64, 1), (64, 2), (64, 4)], component
    assert len(by(LORA_LOAD)) == 1 and report["missing_extras"] == [CONTROLNET_TRANSFER, CFG_EXCHANGE]
    encoder, whole = (min(r.seconds for r in by(c) if r.rows == 2) for c in (DENOISE_ENCODER, DENOISE))
    assert 0 < encoder < whole
    with_addons = BatchShape("tiny-sd", 64, 64, 2, controlnet_rows=(2,), lora_rows=2)
    assert model.denoise_seconds(with_addons) > model.denoise_seconds(batch)
    assert "denoise" in proc.stdout  # the fit report is printed


def test_live_rows_charge_what_a_live_step_costs_beyond_the_in_process_one():
    from stepserve.profiling.common import QUICK, Context, Stopwatch
    from stepserve.profiling.live import LiveResult, live_rows

    ctx = Context("m", "cpu", None, QUICK, Stopwatch("cpu"), "measured today")
    echo = ctx.row(ROUND_OVERHEAD, 0.0015, 200, note="Ray actor round trip")
    # 1 step 0.120 s, 11 steps 0.320 s: 20 ms a step, intercept 100 ms.
    live = LiveResult(64, (1, 11), (0.120, 0.320), 5, worker_step_s=0.025)
    fixed, request = live_rows(ctx, live, in_process_step_s=0.012, model_work_s=0.030, echo=echo, what="64px CFG")
    # Not "minus the worker's execute" (25 ms: more than a pipelined step): minus the in-process step.
    assert fixed.component == ROUND_OVERHEAD and abs(fixed.seconds - 0.008) < 1e-9 and "live app" in fixed.source
    assert abs(request.seconds - 0.070) < 1e-9 and "intercept" in request.source
    # A live step no dearer than in-process: the bare round trip stands; a negative intercept is 0.
    fixed, request = live_rows(ctx, live, in_process_step_s=0.021, model_work_s=0.2, echo=echo, what="64px CFG")
    assert fixed is echo and request.seconds == 0.0
    # The model work timed between the live pairs (45 ms) stands in for the profile's rows.
    from dataclasses import replace

    _, request = live_rows(ctx, replace(live, model_work_s=0.045), 0.012, model_work_s=0.2, echo=echo, what="64px CFG")
    assert abs(request.seconds - 0.055) < 1e-9 and "between the live pairs" in request.source


def test_the_model_work_timed_between_live_pairs_is_what_a_request_does_once():
    from stepserve.engine.families import ALL_PARTS, load_family
    from stepserve.profiling.images import image_model_work
    from stepserve.profiling.video import video_model_work

    image = load_family(ModelConfig(name="tiny-sd", family="sd15", preset="tiny").to_source(), ALL_PARTS, "cpu")
    embeddings, png = image_model_work(image, 64, 2)()
    assert png.startswith(b"\x89PNG") and len(embeddings) > 0
    video = load_family(ModelConfig(name="tiny-wan", family="wan", preset="tiny").to_source(), ALL_PARTS, "cpu")
    _, frames = video_model_work(video, (64, 64, 9))()
    assert frames.dtype.name == "uint8" and frames.shape[0] == 9


def test_live_rows_record_the_host_when_the_live_check_read_it():
    from dataclasses import replace

    from stepserve.policies.cost_model import HOST_IDLE, ROUTER_CPU, ProfiledCostModel
    from stepserve.profiling.common import QUICK, Context, Stopwatch
    from stepserve.profiling.live import LiveResult, live_rows

    ctx = Context("m", "cpu", None, QUICK, Stopwatch("cpu"), "measured today")
    echo = ctx.row(ROUND_OVERHEAD, 0.0015, 200, note="Ray actor round trip")
    # The router spent 20 ms of CPU on a 1-step request and 53 ms on an 11-step one: 3.3 ms a step.
    live = LiveResult(64, (1, 11), (0.120, 0.320), 5, worker_step_s=0.025, idle_cores=0.15,
                      router_cpu_medians_s=(0.020, 0.053))
    rows = live_rows(ctx, live, in_process_step_s=0.012, model_work_s=0.030, echo=echo, what="64px CFG")
    assert [r.component for r in rows] == [ROUND_OVERHEAD, "request_overhead", HOST_IDLE, ROUTER_CPU]
    assert rows[2].latency_ms == pytest.approx(150.0) and rows[3].latency_ms == pytest.approx(3.3)
    model = ProfiledCostModel(rows + [ctx.row("denoise", 0.01, 1, 64, 64, 2)])
    assert model.host_idle_cores() == pytest.approx(0.15) and model.router_cpu_seconds() == pytest.approx(0.0033)
    # A steady plan: the router's CPU does not grow with the steps (noise below is 0, not negative).
    assert replace(live, router_cpu_medians_s=(0.020, 0.019)).router_step_cpu_s == 0.0
    # Processes /proc could not show (a remote cluster): no host rows.
    bare = live_rows(ctx, replace(live, idle_cores=None, router_cpu_medians_s=None), 0.012, 0.030, echo, "64px CFG")
    assert [r.component for r in bare] == [ROUND_OVERHEAD, "request_overhead"]


def test_the_idle_reading_is_the_whole_machine_over_the_window():
    from stepserve.profiling.live import measure_idle_cores

    # A process spinning for the whole window is a core busy: the reading sees it.
    busy = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 3: pass"
    spin = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.5)  # past the interpreter's start
        cores = measure_idle_cores(1.0)
    finally:
        spin.kill()
        spin.wait()
    assert 0.8 <= cores <= (os.cpu_count() or 1)
