"""The elastic denoiser pool on Ray's fake multi-node autoscaling cluster (`scenario.py`): a
burst grows the pool and Ray launches nodes for it, the lull shrinks it back to its minimum and
Ray reclaims the nodes, and not one request fails meanwhile (those in flight while a worker
drains resume elsewhere)."""

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_scenario(out: Path) -> dict:
    # A token of its own: the scenario's cluster and only it (`fake_cluster`).
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.cpu.elastic_live.scenario", str(out)], cwd=ROOT, env=env)
    try:
        proc.wait(timeout=420)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # its cluster ends with it
        proc.wait(timeout=60)
        raise
    assert proc.returncode == 0
    return json.loads(out.read_text())


def test_a_burst_grows_the_pool_idle_shrinks_it_and_no_request_fails(tmp_path):
    result = run_scenario(tmp_path / "elastic.json")
    assert result["errors"] == []
    assert set(result["burst"]) == {200} and set(result["trickle"]) == {200} and len(result["trickle"]) >= 3
    timeline = result["timeline"]
    burst = [s for s in timeline if s["t"] <= result["burst_end_s"]]
    # The router asked for more workers, Ray's autoscaler launched nodes for them, and they served.
    assert max(s["workers"] for s in burst) == 3
    assert max(s["live_workers"] for s in timeline) >= 2
    assert max(s["nodes"] for s in timeline) >= 3  # the head and more than one worker node
    # Idle: back to the minimum, and the nodes with it.
    assert timeline[-1]["workers"] == 1 and timeline[-1]["live_workers"] == 1
    assert timeline[-1]["nodes"] == 2
    assert result["changes"]["grow"] >= 1 and result["changes"]["shrink"] >= 1
