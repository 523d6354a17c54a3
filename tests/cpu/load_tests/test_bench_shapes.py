"""bench_shapes judges what the served engine draws and writes its JSON, plot and grid."""

import json

from stepserve.load_tests import bench_shapes


def test_bench_shapes_writes_its_report(tmp_path):
    assert bench_shapes.main(["--prompts", "4", "--addon-prompts", "2", "--steps", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "shapes.json").read_text())
    rows = report["rows"]
    assert set(rows) == {"exact", "controlnet silhouette", "lora outlined"}
    assert rows["exact"]["renders_judged"] == 1.0  # the judge names the prompts' own renders
    assert rows["exact"]["reconstructions_judged"] >= 0.75  # and their trip through the VAE (97.5% of 200)
    assert all(0 <= v <= 1 for row in rows.values() for v in row.values())
    assert (tmp_path / "shapes.png").stat().st_size > 0 and (tmp_path / "grid.png").stat().st_size > 0
