"""The mask-balance benchmark: its derivation reproduces the paper's figures it starts from, and
its core runs on a tiny case."""

from __future__ import annotations

import json

import pytest

from stepserve.load_tests.bench_mask_balance_sim import DIMS, FLUX, PAPER, SDXL, derive, edit_model, main
from stepserve.policies.instgenie import Loading


def test_the_derived_models_reproduce_the_papers_numbers():
    derived = derive(25.0)
    flux = edit_model(FLUX, derived["lines"][FLUX], 25.0)
    steps = PAPER["flux_steps"]
    assert steps * flux.seconds(1024, 1024, 1, 1.0) == pytest.approx(2.27 * 1.9)
    assert steps * flux.seconds(1024, 1024, 1, 0.2, Loading.IDEAL) == pytest.approx(2.27)
    # SDXL at the paper-implied bandwidth: Fig. 4-left's ideal and naive edits exactly.
    sdxl = edit_model(SDXL, derived["lines"][SDXL], derived["implied_gbps"])
    ratio = derived["report"]["sdxl"]["fig4_ideal_mask_ratio"]
    assert 0.25 < ratio < 0.45  # near the try-on benchmark's mean mask ratio, 0.35
    assert 50 * sdxl.seconds(1024, 768, 2, ratio, Loading.IDEAL) == pytest.approx(1.06)
    assert 50 * sdxl.seconds(1024, 768, 2, ratio, Loading.NAIVE) == pytest.approx(2.14)
    assert 5 < derived["implied_gbps"] < 20 and len(DIMS[SDXL]) == 2


def test_a_tiny_run_writes_its_results(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--workers", "2", "--duration", "40", "--rates", "0.5",
                 "--ratios", "0.2"]) == 0
    report = json.loads((tmp_path / "mask_balance.json").read_text())
    (run,) = report["placement"]
    assert set(run["policies"]) == {"continuous (JSQ by requests)", "mask_aware", "mask_aware, one-step cost",
                                    "composed"}
    assert all(p["p95_s"] >= p["p50_s"] > 2.0 for p in run["policies"].values())
    assert len(report["loading"]) == 4  # two models x two bandwidths x one ratio
    for row in report["loading"]:
        over = row["over_ideal"]
        assert over["naive"] >= over["always_load"] >= over["algorithm1"] >= over["optimal"] >= over["ideal"] == 0
    assert (tmp_path / "mask_balance.png").stat().st_size > 20_000
    assert (tmp_path / "mask_balance_cdfs.png").stat().st_size > 10_000
    assert "P95 vs JSQ" in capsys.readouterr().out
