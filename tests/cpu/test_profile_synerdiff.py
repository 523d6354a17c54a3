"""`stepserve profile-concurrency` (SynerDiff's offline profiler) on the shipped shapes model: it
measures real concurrent rounds (a step beside decode chunks in a second thread), picks c and
B_max from them, and writes a table the planner reads."""

import json

from stepserve.cli import main
from stepserve.deployments.config import VAEDecoderConfig
from stepserve.policies.synerdiff import Round, plan_sequence


def test_the_profile_is_a_table_the_planner_plans_with(tmp_path):
    out = tmp_path / "profile"
    assert main(["profile-concurrency", "--max-batch", "2", "--most-chunks", "2", "--repeats", "1",
                 "--out", str(out)]) == 0
    report = json.loads((out / "concurrency.json").read_text())
    assert 1 <= report["b_max"] <= 2 and report["chunks"] in (1, 2) and report["decode_alone_s"] > 0
    # The config reads it as the table of the model at the size it was measured at.
    decoder = VAEDecoderConfig(on_workers=True, chunks=report["chunks"], sequencer_profile=str(out / "concurrency.csv"))
    (key, table), = decoder.sequencer_tables().items()
    assert key == ("shapes", 64, 64) == (report["model"], report["size"], report["size"])
    b = report["b_max"]
    assert table.max_batch == b
    assert table.has(Round(b, b, b)) and table.has(Round(0, 1, 0))
    plan = plan_sequence(b, b, b, table, 0.1)
    assert plan.unet == b and plan.vae == b
    assert (out / "concurrency.png").stat().st_size > 0
