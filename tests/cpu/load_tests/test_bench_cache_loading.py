"""The cache-loading benchmark end to end on the tiny SD3 transformer on CPU: every plan's
forward, its measured and predicted latency, the slots it loads, and the plot, with either cache
kind. On CPU nothing is copied (L = 0), so every plan predicts the ideal latency and every
forward must give the exact output (the cache is recorded from the same inputs)."""

import json

import pytest

from stepserve.load_tests.bench_cache_loading import main

PLANS = {"outputs": {"ideal", "naive", "always_load", "algorithm1", "optimal"},
         "keys_values": {"ideal", "naive", "always_load"}}  # every slot must load: no DP choice


@pytest.mark.parametrize("cache", sorted(PLANS))
def test_the_tiny_cpu_run_writes_its_json_and_plot(tmp_path, cache):
    assert main(["--config", "tiny", "--device", "cpu", "--warmup", "1", "--repeats", "2", "--cost-repeats", "1",
                 "--threads", "1", "--cache", cache, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cache_loading.json").read_text())
    assert result["cache"] == cache
    assert result["slots"] == result["blocks"] + (cache == "keys_values") == len(result["slot_cache_mb"])
    assert [r["mask_ratio"] for r in result["results"]] == [0.1, 0.2, 0.5]
    assert len(result["exact_samples_s"]) == 2
    for row in result["results"]:
        assert set(row["cases"]) == PLANS[cache]
        costs = row["costs"]
        assert all(len(costs[k]) == result["slots"] for k in ("c_with", "c_without", "load"))
        assert costs["load"] == [0.0] * result["slots"]
        ideal = row["cases"]["ideal"]
        assert ideal["loads"] == [] and ideal["overhead_vs_ideal"] == 0.0
        for name, case in row["cases"].items():
            assert len(case["samples_s"]) == 2 and case["measured_s"] > 0
            # Loading is free here: a plan that loads every slot predicts the ideal; a DP may also
            # compute a block in full where that measured faster (noisy on a busy CPU), never slower.
            if name in ("algorithm1", "optimal"):
                assert case["predicted_blocks_s"] <= ideal["predicted_blocks_s"] + 1e-12
            else:
                assert case["predicted_blocks_s"] == ideal["predicted_blocks_s"]
            assert case["loaded_mb"] == 0.0  # and nothing is copied
            assert case["vs_exact"]["rel_l2"] < 1e-5, name
        assert row["cases"]["naive"]["loads"] == list(range(result["slots"]))
    assert (tmp_path / "cache_loading.png").stat().st_size > 10_000
