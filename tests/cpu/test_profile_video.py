"""`stepserve profile --quick` on the tiny Wan: video rows with frames, denoise at SP degrees 1
and 2 (two processes over gloo), and a CSV the cost model answers video steps from."""

import os
import subprocess
import sys

import pytest
import yaml

from stepserve.policies.cost_model import (
    DENOISE,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    ProfiledCostModel,
    read_profile,
)

CONFIG = {
    "applications": [{
        "name": "stepserve",
        "import_path": "stepserve.deployments.app:build_app",
        "args": {
            "models": [{"name": "tiny-wan", "family": "wan", "preset": "tiny"}],
            "workers": {"num_workers": 2, "device": "cpu", "torch_threads": 1},
            "router": {"policy": "genserve", "profiles": ["tiny-wan-cpu"]},
            "text_encoder": {"device": "cpu", "torch_threads": 1},
            "vae_decoder": {"device": "cpu", "torch_threads": 1},
        },
    }],
}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="SP degree 2 needs two cores")
def test_quick_video_profile(tmp_path):
    config = tmp_path / "video.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    out = tmp_path / "tiny-wan-cpu.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "stepserve.cli", "profile", "--config", str(config), "--model", "tiny-wan",
         "--device", "cpu", "--quick", "--out", str(out), "--num-cpus", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[denoise] SP 2" in proc.stderr and "wrote" in proc.stderr

    rows = read_profile(out)
    assert {r.model for r in rows} == {"tiny-wan"} and {r.device for r in rows} == {"cpu"}
    assert all(r.latency_ms > 0 and r.source.startswith("measured ") for r in rows)
    by = lambda component: [r for r in rows if r.component == component]  # noqa: E731
    # Quick grid: 32 and 48 px, 5 frames, rows 1 and 2 (CFG off/on), at SP degrees 1 and 2.
    shapes = [(32, 1), (32, 2), (48, 1), (48, 2)]
    for degree in (1, 2):
        denoise = [r for r in by(DENOISE) if r.sp_degree == degree]
        assert sorted((r.height, r.rows) for r in denoise) == shapes, degree
        assert {r.frames for r in denoise} == {5}
    assert all("over 2 processes" in r.source for r in by(DENOISE) if r.sp_degree == 2)
    assert sorted((r.height, r.frames) for r in by(VAE_DECODE)) == [(32, 5), (48, 5)]
    assert sorted(r.rows for r in by(TEXT_ENCODE)) == [1, 2]
    fixed = by(ROUND_OVERHEAD)
    assert len(fixed) == 1 and fixed[0].height == 0 and "Ray actor round trip" in fixed[0].source
    assert all(r.sp_degree == 1 for r in rows if r.component != DENOISE)

    model = ProfiledCostModel.from_csv(out)
    assert model.sp_degrees("tiny-wan") == (1, 2)
    for degree in (1, 2):
        step = model.video_step_seconds("tiny-wan", 48, 48, 5, degree)
        assert step >= model.video_step_seconds("tiny-wan", 48, 48, 5, degree, cfg=False) > 0
    assert model.video_step_seconds("tiny-wan", 64, 64, 9, 2) > 0  # beyond the grid: extrapolated
    assert model.decode_seconds("tiny-wan", 48, 48, 5) >= model.decode_seconds("tiny-wan", 32, 32, 5) > 0
    report = model.fit_report()["tiny-wan"]
    assert report["missing"] == ["request_overhead"]  # no live app for videos
    assert {"denoise", "denoise@sp2"} <= set(report["components"])
    assert "denoise@sp2" in proc.stdout and "video step" in proc.stdout
