"""The simulated-run entry points write their JSON and PNGs (small runs on the shipped CPU profile)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import yaml

from stepserve.load_tests import compare_policies
from stepserve.load_tests.sim import __main__ as sim_main
from stepserve.load_tests.sweep import add_sim_args, config_from_args, sim_config_from_serve
from stepserve.runtime import tiny_config_path, load_serve_config


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


def test_the_cluster_comes_from_a_serve_config_and_explicit_flags_win(tmp_path):
    serve = load_serve_config(tiny_config_path())
    app_args = serve["applications"][0]["args"]
    app_args["router"] = {**app_args["router"], "pipeline_depth": 3, "pipeline_lead_s": 0.02,
                          "max_queued_images": 7, "max_queued_videos": 3}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    fields = sim_config_from_serve(path)
    assert (fields["workers"], fields["policy"], fields["pipeline_depth"], fields["pipeline_lead_s"]) == (
        app_args["workers"]["num_workers"], "continuous", 3, 0.02)
    assert (fields["max_queued_images"], fields["max_queued_videos"]) == (7, 3)

    parser = argparse.ArgumentParser()
    add_sim_args(parser)
    args = parser.parse_args(["--workload", "local-tiny", "--profile", "tiny-sd-cpu", "--out", str(tmp_path),
                              "--serve-config", str(path), "--pipeline-lead", "inf", "--max-queued-images", "9"])
    config = config_from_args(args)
    assert config.pipeline_lead_s == math.inf and config.pipeline_depth == 3
    assert (config.max_queued_images, config.max_queued_videos) == (9, 3)


def test_workers_that_pack_resolutions_are_simulated_packing(tmp_path):
    """`workers.pack_resolutions` reaches the simulation: the packing models' rounds are priced as
    one forward, as the live router prices them (on this CPU profile packing is the slower way:
    what matters here is that it is the way simulated)."""
    from stepserve.load_tests.sim import SimConfig, simulate
    from stepserve.load_tests.workload import generate, load_workload
    from stepserve.policies.cost_model import load_profile

    serve = load_serve_config(tiny_config_path())
    app_args = serve["applications"][0]["args"]
    app_args["workers"] = {**app_args["workers"], "pack_resolutions": True}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    fields = sim_config_from_serve(path)
    assert fields["packing"] == tuple(m["name"] for m in app_args["models"])
    assert sim_config_from_serve(tiny_config_path())["packing"] == ()

    cost = load_profile("tiny-sd-cpu")
    spec = load_workload("local-tiny")
    model = spec.classes[0].model
    requests = [replace(r, width=size, height=size) for r, size in zip(generate(spec.with_rate(8.0), cost)[:24],
                                                                        [64, 96, 128] * 8)]
    plain = simulate(requests, cost, SimConfig(workers=1, decoders=1))
    packing = simulate(requests, cost, SimConfig(workers=1, decoders=1, packing=(model,)))
    assert packing.forwards < plain.forwards and packing.end_s != plain.end_s
