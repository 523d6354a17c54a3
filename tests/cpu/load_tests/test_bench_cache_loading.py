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


def test_the_disk_run_reads_every_loaded_slot_and_stays_exact(tmp_path):
    """`--host disk`: the record is spilled and read back slot by slot (threaded for pipelined
    plans); L is a real read (> 0), the bytes each plan loads are its slots' bytes, and every
    forward still equals the exact one."""
    out, disk = tmp_path / "out", tmp_path / "disk"
    assert main(["--config", "tiny", "--host", "disk", "--disk-dir", str(disk), "--warmup", "1", "--repeats", "2",
                 "--cost-repeats", "1", "--threads", "1", "--ratios", "0.2", "--out", str(out)]) == 0
    result = json.loads((out / "cache_loading.json").read_text())
    assert result["host"] == "disk" and (disk / "record.safetensors").exists()
    (row,) = result["results"]
    assert all(load > 0 for load in row["costs"]["load"])
    for name, case in row["cases"].items():
        assert case["loaded_mb"] == pytest.approx(sum(result["slot_cache_mb"][b] for b in case["loads"])), name
        assert case["vs_exact"]["rel_l2"] < 1e-5, name
    assert row["cases"]["naive"]["loaded_mb"] == pytest.approx(sum(result["slot_cache_mb"]))


def test_disk_is_refused_off_cpu():
    with pytest.raises(SystemExit):
        main(["--host", "disk", "--device", "cuda", "--out", "unused"])
