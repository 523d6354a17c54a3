"""bench_step_cache measures step caching's speed and fidelity per threshold, with every request
caching and with half of them, and writes its JSON and plot; exact partners stay exact."""

import json

from stepserve.load_tests import bench_step_cache


def test_bench_step_cache_writes_its_report(tmp_path):
    assert bench_step_cache.main(["--prompts", "2", "--steps", "4", "--batch", "2", "--repeats", "1",
                                  "--thresholds", "0.3", "--threads", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_cache.json").read_text())
    rows = {(row["method"], row["batch"]): row for row in report["rows"]}
    assert set(rows) == {(method, batch) for method in ("first_block", "taylorseer") for batch in ("all", "half")}
    for method in ("first_block", "taylorseer"):
        assert rows[method, "half"]["caching_share"] == 0.5
        assert rows[method, "half"]["partners_max_pixel_difference"] == 0  # the exact partner of a caching request
    assert all(0 < row["speedup"] and 0 <= row["skipped_step_share"] < 1 and 0 < row["ssim"] <= 1
               for row in rows.values())
    assert (tmp_path / "step_cache.png").stat().st_size > 0


def test_bench_step_cache_measures_caching_with_skip_cfg(tmp_path):
    assert bench_step_cache.main(["--prompts", "2", "--steps", "4", "--batch", "2", "--repeats", "1",
                                  "--thresholds", "0.3", "--methods", "first_block", "--skip-cfg-from", "0.5",
                                  "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = {row["batch"]: row for row in json.loads((tmp_path / "step_cache.json").read_text())["rows"]}
    assert set(rows) == {"all", "half", bench_step_cache.SKIPPING}
    both, caching = rows[bench_step_cache.SKIPPING], rows["all"]
    assert (both["skip_cfg_from"], caching["skip_cfg_from"]) == (0.5, 1.0) and both["caching_share"] == 1.0
    assert both["ssim"] != caching["ssim"]  # its last two steps ran unguided: other pictures
