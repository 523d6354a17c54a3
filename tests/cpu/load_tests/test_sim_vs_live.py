"""The simulator agrees with the live app: small cases of load_tests/sim_vs_live.py.

Slow (minutes each: a profile of this machine, then three live runs, whose medians the
simulator is held to) and timing-sensitive, so they run with the benchmarks on a quiet machine,
not in CI: `python -m pytest -m slow -k sim_vs_live`.
The comparison's logic without a live app is tested in test_sim_vs_live_kinds.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepserve.load_tests import sim_vs_live

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.slow
def test_simulated_latency_within_15_percent_of_live(tmp_path):
    # configs/local-tiny.yaml (2 CPU workers), local-tiny at its moderate 3 req/s for 45 s, profile
    # measured first on this machine.
    rc = sim_vs_live.main(["--out", str(tmp_path), "--duration", "45", "--policies", "continuous"])
    report = json.loads((tmp_path / "sim_vs_live.json").read_text())
    [run] = report["runs"]
    assert run["live"]["failed"] == 0 and run["live"]["ok"] == run["sim"]["ok"]
    errors = {k: round(v, 3) for k, v in run["error"].items()}
    assert abs(run["error"]["latency_p50_s"]) <= 0.15 and abs(run["error"]["latency_p95_s"]) <= 0.15, errors
    assert rc == 0


@pytest.mark.slow
def test_image_and_video_latency_within_15_percent_of_live(tmp_path):
    # configs/local-video.yaml (tiny-sd + tiny-wan on 2 CPU workers, genserve), local-video-tiny
    # for 45 s, both models profiled first on this machine; the bar holds the run and each kind.
    config = CONFIGS / "local-video.yaml"
    rc = sim_vs_live.main(["--out", str(tmp_path), "--duration", "45", "--config", str(config),
                           "--workload", "local-video-tiny", "--policies", "genserve"])
    report = json.loads((tmp_path / "sim_vs_live.json").read_text())
    [run] = report["runs"]
    assert run["live"]["failed"] == 0 and run["live"]["ok"] == run["sim"]["ok"]
    assert set(run["kinds"]) == {"image", "video"}
    errors = {scope: run["error"] if scope == "all" else run["kinds"][scope]["error"] for scope in run["held"]}
    assert run["held"][0] == "all" and run["agrees"], errors
    assert rc == 0
