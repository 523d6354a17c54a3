"""The policy in the simulator (the live RouterCore, timed by a GPU-magnitude profile), its
discards failing there, and the mixed-resolution benchmark at a tiny setting."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stepserve.load_tests import bench_mixed_res_sim as bench
from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.workload import generate
from stepserve.policies.cost_model import load_profile
from stepserve.policies.patchedserve import PackedForwardCosts

SDXL = "stable-diffusion-xl-base-1.0"


@pytest.fixture(scope="module")
def sdxl():
    return load_profile("sdxl-h800")


def config(**options) -> SimConfig:
    return SimConfig(workers=3, max_batch_size=12, policy="patchedserve", policy_options=options, decoders=3,
                     text_encoder=TextEncoderSpec(replicas=1), max_queued_images=10_000)


@pytest.mark.parametrize("mix", [False, True])
def test_a_short_run_serves_every_request_or_discards_it(sdxl, mix):
    requests = generate(bench.workload(SDXL, 5.0, 60, seed=1), sdxl)
    costs = PackedForwardCosts(sdxl) if mix else sdxl
    result = simulate(requests, costs, config(predictor="cost_model"))
    assert len(result.traces) == 60
    assert {t.status for t in result.traces} <= {"finished", "failed"}
    for t in result.traces:
        if t.status == "failed":
            assert t.admit_s is None  # discarded while waiting: no work was spent on it
    summary = result.summary(offered_rps=5.0)
    # 5 req/s on 3 workers is far past what they serve (about 2 of these a second): it discards
    # some (13 to 17 here), and most of the rest meet their SLO (over 90% here).
    assert summary.failed >= 5 and summary.slo_met / summary.ok > 0.8


def test_requests_that_cannot_make_their_deadlines_fail_without_running(sdxl):
    spec = replace(bench.workload(SDXL, 1.0, 12, seed=0), slo_scale=0.5)  # half the solo latency
    result = simulate(generate(spec, sdxl), sdxl, config(predictor="cost_model"))
    assert [t.status for t in result.traces] == ["failed"] * 12
    assert all(t.admit_s is None for t in result.traces) and result.rounds == 0


def test_goodput_at_90_percent_is_the_crossing_rate():
    assert bench.goodput_at([(2, 1.0), (4, 0.95), (6, 0.85)]) == {"rps": pytest.approx(5.0), "at_least": False}
    assert bench.goodput_at([(4, 0.95), (2, 1.0)]) == {"rps": 4, "at_least": True}
    assert bench.goodput_at([(2, 0.8), (4, 0.95)]) == {"rps": None, "at_least": False}


def test_the_benchmark_writes_its_json_and_figure(tmp_path):
    assert bench.main(["--out", str(tmp_path), "--models", "sdxl", "--sdxl-rates", "2,4", "--requests", "16",
                       "--workers", "2"]) == 0
    report = json.loads((tmp_path / "mixed_res.json").read_text())
    entry = report["models"]["sdxl"]
    assert {run["policy"] for run in entry["runs"]} == {label for label, *_ in bench.ROWS}
    assert len(entry["runs"]) == 2 * len(bench.ROWS)
    assert set(entry["goodput_at_90"]) == {label for label, *_ in bench.ROWS}
    assert entry["analyzer_holdout"]["packed"]["mean_rel_err"] < 0.037
    assert all(e["packed_ms"] < e["separate_ms"] for e in entry["packing_examples"])
    assert (tmp_path / "mixed_res_sdxl.png").stat().st_size > 10_000
