"""The mixed-everything benchmark (images with add-ons, edits, videos on one pool) at a tiny
setting: the mix is what its docstring says, every policy serves it, and the report holds what
the README quotes."""

from __future__ import annotations

import json

from stepserve.load_tests import bench_mixed_all_sim as bench
from stepserve.load_tests.edit_workload import ScheduledEdit


def test_the_mix_holds_images_with_addons_edits_and_videos():
    args = bench.parse_args(["--out", "unused", "--requests", "200", "--video-share", "0.1"])
    requests = bench.requests_at(args, 2.0, bench.costs(args.load_gbps))
    kinds = [bench.kind_of(r) for r in requests]
    count = {k: kinds.count(k) for k in bench.CLASSES}  # 120 / 64 / 16 with seed 0
    assert 10 <= count["video"] <= 30 and 0.2 <= count["edit"] / (count["edit"] + count["image"]) <= 0.4, count
    images = [r for r, k in zip(requests, kinds) if k == "image"]
    assert all(r.controlnets for r in images) and sum(bool(r.loras) for r in images) > 0.9 * len(images)
    edits = [r for r in requests if isinstance(r, ScheduledEdit)]
    assert all(not r.controlnets and not r.loras and 0 < r.mask_ratio <= 1 for r in edits)
    assert all(r.slo_s is not None for r in requests) and all(r.num_frames == 81 for r in requests if r.is_video)


def test_every_policy_serves_the_mix_and_the_report_is_written(tmp_path):
    assert bench.main(["--out", str(tmp_path), "--requests", "40", "--rates", "1,3"]) == 0
    report = json.loads((tmp_path / "mixed_all.json").read_text())
    assert (tmp_path / "mixed_all.png").stat().st_size > 0
    assert set(report["goodput_at_90"]) == {label for label, *_ in bench.ROWS}
    for run in report["runs"]:
        assert sum(c["requests"] for c in run["classes"].values()) == 40
        assert run["summary"]["ok"] + run["discarded"] == 40
    assert "vs_best_single" in report["goodput_at_90"]["composed"]
