"""configs/cluster.yaml is one coherent design: the simulator runs it as the router would (its
composed policy, packing workers, ControlNet placement and queue bounds) on the measured H200
profiles its router lists, over every model it serves at once, and serves the light load whole."""

import json

import yaml

from stepserve.load_tests.sim.__main__ import main as simulate
from stepserve.runtime import CONFIGS


def test_the_cluster_config_serves_its_whole_mix_in_the_simulator(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPSERVE_API_KEYS", "sk-test")  # the cluster reads its keys from there
    (app,) = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())["applications"]
    router, workers = app["args"]["router"], app["args"]["workers"]
    assert simulate(["--serve-config", str(CONFIGS / "cluster.yaml"), "--profile", ",".join(router["profiles"]),
                     "--workload", "cluster-mixed", "--workers", str(workers["num_workers"]), "--rates", "3",
                     "--duration", "40", "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "sim.json").read_text())["runs"]
    assert run["policy"] == "composed"
    summary = run["summary"]
    assert summary["count"] > 100 and summary["ok"] == summary["count"]
    assert summary["slo_attainment"] >= 0.95, summary
    assert (tmp_path / "sim_latency_cdf.png").stat().st_size > 0
