"""The add-on benchmarks' own logic: the mix, the paired LoRA overhead, the GPU-magnitude
ControlNet step model and the stale-ControlNet fidelity run (tiny)."""

import json
import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from stepserve.load_tests import bench_stale_controlnet
from stepserve.load_tests.addon_mix import AddonMix
from stepserve.load_tests.bench_addons import lora_overhead
from stepserve.load_tests.bench_controlnet_parallel import TRANSPORTS, Shares, shares, step_times


def test_the_mix_follows_table_1_and_its_popularities():
    mix = AddonMix.service("B", ["canny", "depth", "pose"], [f"l{i}" for i in range(30)])
    rng = random.Random(0)
    draws = [mix.draw(rng) for _ in range(4000)]
    cn_counts = Counter(len(c) for c, _ in draws)
    assert cn_counts[2] / 4000 == pytest.approx(0.699, abs=0.03) and cn_counts[3] / 4000 == pytest.approx(0.031, abs=0.01)
    assert Counter(len(lo) for _, lo in draws)[1] / 4000 == pytest.approx(0.736, abs=0.03)
    assert all(len(set(c)) == len(c) and len(set(lo)) == len(lo) for c, lo in draws)
    loras = Counter(x for _, lo in draws for x in lo)
    assert loras["l0"] > 3 * loras["l5"] and len(loras) > 20  # long-tailed, and the tail is used
    with pytest.raises(ValueError, match="more distinct add-ons"):
        AddonMix.service("B", ["canny"], ["l0"])


def test_lora_overhead_pairs_each_lora_request_with_itself():
    requests = [SimpleNamespace(loras=("a",)), SimpleNamespace(loras=()), SimpleNamespace(loras=("b",))]
    out = lora_overhead([1.0, 5.0, 2.0], [0.8, 1.0, None], requests)
    assert out["requests"] == 1 and out["median_added_s"] == pytest.approx(0.2)
    assert out["mean_fraction"] == pytest.approx(0.2)


def test_the_step_model_is_sequential_against_the_critical_path():
    s = Shares(down=0.3, mid=0.1, up=0.6, controlnet=0.45, residual_bytes=10 << 20, unet_tflops=1.0)
    nvlink, host, stale = TRANSPORTS
    one = step_times(s, 0.05, 1, nvlink)
    assert one["sequential_s"] == pytest.approx(0.05 * 1.45)
    assert one["ideal_s"] == pytest.approx(0.05 * (0.45 + 0.6))
    assert one["speedup"] <= one["ideal_speedup"]
    assert step_times(s, 0.05, 1, host)["speedup"] < one["speedup"]
    assert step_times(s, 0.05, 3, stale)["parallel_s"] == pytest.approx(0.05)  # hidden behind the UNet step


def test_flop_shares_of_the_tiny_unet_add_up():
    s = shares("sd15", "tiny", 64, 2)
    assert s.down + s.mid + s.up == pytest.approx(1.0, abs=0.02) and s.controlnet > 0
    assert s.residual_bytes > 0


def test_the_stale_controlnet_benchmark_runs(tmp_path):
    assert bench_stale_controlnet.main(["--steps", "3", "--seeds", "0", "--size", "32", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "stale_controlnet.json").read_text())
    for row in report["summary"]:
        assert row["no_controlnet_psnr_db"] < row["stale_psnr_db"] < math.inf
    assert (tmp_path / "stale_controlnet.png").stat().st_size > 10_000


def test_the_live_latent_parallel_benchmark_counts_split_steps_and_spaces_its_light_load():
    from stepserve.load_tests.bench_latent_parallel import parse_args, split_steps, workloads

    exposition = ('# TYPE stepserve_split_steps counter\nstepserve_split_steps_total{split="cfg"} 12.0\n'
                  'stepserve_split_steps_total{split="sequence"} 5.0\n')
    assert split_steps(exposition) == 12.0 and split_steps("") == 0.0
    loads = workloads(parse_args(["--out", "x", "--requests", "4", "--gap", "2"]), repeat=0)
    assert [r.offset_s for r in loads["light"]] == [0.0, 2.0, 4.0, 6.0]
    assert [r.seed for r in loads["light"]] == [r.seed for r in loads["loaded"]]  # the same requests
    assert loads["loaded"][-1].offset_s < 6.0  # 3 req/s: they overlap
