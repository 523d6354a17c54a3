"""The simulator prices add-ons from the profile, and the add-on benchmark reproduces its claims
at GPU magnitude on a small run."""

from __future__ import annotations

import json

import pytest

from stepserve.load_tests.bench_addons_sim import main
from stepserve.load_tests.sim.simulator import SimConfig, simulate
from stepserve.load_tests.workload import ScheduledRequest
from stepserve.policies.addon_costs import ControlNetPlacement
from stepserve.policies.cost_model import BatchShape, load_profile
from stepserve.policies.types import ControlNetUse, LoraUse, RequestSpec

MODEL = "stable-diffusion-xl-base-1.0"


@pytest.mark.parametrize("placement", list(ControlNetPlacement))
def test_a_lone_request_steps_at_the_profiles_price_of_its_addons(placement):
    request = ScheduledRequest(0, 0.0, 10, 0, 1024, 1024, 7.5, "p", model=MODEL, controlnets=("canny", "depth"),
                               loras=("x",))
    cost = load_profile("sdxl-h800", controlnets=placement)
    (trace,) = simulate([request], cost, SimConfig(workers=1)).traces
    spec = RequestSpec("r0", MODEL, "p", 1024, 1024, 10, 7.5, 0, controlnets=(ControlNetUse("canny"),
                       ControlNetUse("depth")), loras=(LoraUse("x"),))
    # Its plan first brings its LoRA to the worker.
    assert trace.finish_s - trace.admit_s == pytest.approx(10 * cost.step_seconds(BatchShape.of([spec]))
                                                           + cost.lora_load_seconds(MODEL))
    plain = cost.step_seconds(BatchShape(MODEL, 1024, 1024, 2))
    assert cost.step_seconds(BatchShape.of([spec])) > plain * 1.05  # the add-ons cost something everywhere


def test_the_controlnet_service_time_is_counted_only_where_it_runs():
    request = ScheduledRequest(0, 0.0, 10, 0, 1024, 1024, 7.5, "p", model=MODEL, controlnets=("canny",))
    busy = {p: simulate([request], load_profile("sdxl-h800", controlnets=p), SimConfig(workers=1)).controlnet_busy_s
            for p in ControlNetPlacement}
    assert busy[ControlNetPlacement.INLINE] == 0.0
    assert busy[ControlNetPlacement.SERVICE] > 0
    assert busy[ControlNetPlacement.SERVICE] == pytest.approx(busy[ControlNetPlacement.STALE])


def test_the_benchmark_reaches_the_ideal_and_mixed_loras_out_batch_one_adapter_a_forward(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--duration", "40", "--burst", "64", "--loras", "40", "--services", "B",
                 "--steps", "20"]) == 0
    report = json.loads((tmp_path / "addons_sim.json").read_text())
    for entry in report["controlnets"]:
        light = entry["loads"]["light"]["runs"]
        assert light["service"]["of_ideal"] >= 0.95 and light["stale"]["of_ideal"] >= 0.95
        assert entry["ideal_speedup"] == pytest.approx(entry["paper"]["ideal"], rel=0.05)
        assert entry["loads"]["heavy"]["runs"]["service"]["step_speedup"] > 1
    (service,) = report["loras"]
    mixed, per_adapter = service["runs"]["mixed"], service["runs"]["per_adapter"]
    assert mixed["requests_per_forward"] > 2 * per_adapter["requests_per_forward"]
    assert service["throughput_gain"] > 1.05
    assert mixed["finished"] == per_adapter["finished"] == service["runs"]["composed"]["finished"] == 64
    assert (tmp_path / "addons_sim.png").stat().st_size > 20_000
    assert "mixed/per-adapter" in capsys.readouterr().out


def test_a_simulation_does_not_depend_on_string_hashing(tmp_path):
    """Sets of worker ids iterate in an order PYTHONHASHSEED decides; the simulator and the core
    must not let that order reach a decision."""
    import os
    import subprocess
    import sys

    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        subprocess.run([sys.executable, "-m", "stepserve.load_tests.bench_addons_sim", "--out", str(out),
                        "--duration", "20", "--burst", "48", "--loras", "40", "--services", "A", "--steps", "10"],
                       check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed})
        outputs.append((out / "addons_sim.json").read_text())
    assert outputs[0] == outputs[1]
