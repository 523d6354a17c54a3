import json

from stepserve.load_tests.bench_elastic_pool import main


def test_the_benchmark_writes_its_json_and_plot_and_scaling_helps_through_the_step(tmp_path):
    args = ["--out", str(tmp_path), "--phases", "60:0.5,150:2.5,60:0.5", "--start-s", "20", "--max-workers", "6"]
    assert main(args) == 0
    report = json.loads((tmp_path / "elastic_pool.json").read_text())
    small, elastic, large = report["runs"]
    assert [r["label"] for r in report["runs"]] == ["fixed 2", "elastic 2-6", "fixed 6"]
    assert all(r["unfinished"] == 0 for r in report["runs"])
    assert elastic["summary"]["slo_attainment"] > small["summary"]["slo_attainment"]
    assert elastic["worker_s"] < large["worker_s"]
    assert max(size for _, size in elastic["pool"]) > 2 and elastic["pool"][-1][1] == 2
    assert (tmp_path / "elastic_pool.png").stat().st_size > 10_000
