"""The simulated-run entry points write their JSON and PNGs (small runs on the shipped CPU profile)."""

from __future__ import annotations

import json

from stepserve.load_tests import compare_policies
from stepserve.load_tests.sim import __main__ as sim_main


def test_compare_policies_writes_the_report(tmp_path, capsys):
    rc = compare_policies.main([
        "--workload", "local-tiny", "--profile", "tiny-sd-cpu", "--workers", "2", "--decoders", "1",
        "--num-requests", "40", "--rates", "3,6", "--out", str(tmp_path),
        "--policy-options", '{"dynamic_batching": {"window_s": 0.25}}',
    ])
    assert rc == 0
    report = json.loads((tmp_path / "policies.json").read_text())
    runs = {(r["policy"], r["rate"]): r for r in report["runs"]}
    assert set(runs) == {(p, rate) for p in ("static_fcfs", "dynamic_batching", "continuous") for rate in (3.0, 6.0)}
    assert runs[("dynamic_batching", 3.0)]["policy_options"] == {"window_s": 0.25}
    assert all(r["summary"]["count"] == 40 and r["summary"]["slo_attainment"] is not None for r in runs.values())
    assert report["cluster"]["workers"] == 2 and report["workload"]["name"] == "local-tiny"
    for name in ("policies_vs_load.png", "policies_bars.png", "policies_latency_cdf.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert "dynamic_batching" in capsys.readouterr().out


def test_sim_one_policy_with_traces_and_errors(tmp_path, capsys):
    rc = sim_main.main(["--workload", "local-tiny", "--profile", "tiny-sd-cpu", "--workers", "2",
                        "--num-requests", "20", "--policy", "static_fcfs", "--traces", "--out", str(tmp_path)])
    assert rc == 0
    [run] = json.loads((tmp_path / "sim.json").read_text())["runs"]
    assert run["policy"] == "static_fcfs" and len(run["traces"]) == 20
    assert (tmp_path / "sim_latency_cdf.png").exists() and not (tmp_path / "sim_vs_load.png").exists()
    assert sim_main.main(["--workload", "no-such", "--profile", "tiny-sd-cpu", "--out", str(tmp_path)]) == 2
    assert "no workload" in capsys.readouterr().err
