"""The SynerDiff benchmarks write their reports: bench_skip_cfg (the skip-CFG curve and speed,
exact partners staying exact) and bench_synerdiff (the simulated full stack, naive continuous
batching and one ablation row per component)."""

import json

from stepserve.load_tests import bench_skip_cfg, bench_synerdiff


def test_bench_skip_cfg_writes_its_curve(tmp_path):
    assert bench_skip_cfg.main(["--prompts", "2", "--steps", "4", "--batch", "2", "--repeats", "1",
                                "--starts", "0,0.5", "--threads", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "skip_cfg.json").read_text())
    rows = {(row["start"], row["batch"]): row for row in report["rows"]}
    assert set(rows) == {(start, batch) for start in (0.0, 0.5) for batch in ("all", "half")}
    assert rows[0.0, "half"]["skipping_share"] == 0.5
    assert rows[0.0, "half"]["partners_max_pixel_difference"] == 0  # the exact partner of a skipping request
    assert [point[0] for point in report["curve"]] == [0.0, 0.5]
    assert all(0 < row["ssim"] <= 1 and row["speedup"] > 0 for row in rows.values())
    assert (tmp_path / "skip_cfg.png").stat().st_size > 0


def test_bench_synerdiff_writes_every_variant(tmp_path):
    assert bench_synerdiff.main(["--requests", "40", "--rates", "0.3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "synerdiff.json").read_text())
    (load,) = report["loads"]
    assert set(load["rows"]) == set(bench_synerdiff.VARIANTS)
    assert all(row["served"] + row["rejected_or_failed"] == 40 for row in load["rows"].values())
    assert load["throughput_vs_naive"] > 0 and (tmp_path / "synerdiff.png").stat().st_size > 0
