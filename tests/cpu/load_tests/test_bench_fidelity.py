"""bench_fidelity measures each approximation switch against the exact path on the shapes models
and writes its JSON and plot; a switch at its exact setting reproduces the exact pictures."""

import json

from stepserve.load_tests import bench_fidelity


def test_bench_fidelity_writes_its_report(tmp_path):
    assert bench_fidelity.main(["--prompts", "2", "--steps", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "fidelity.json").read_text())
    rows = {(r["approximation"], r.get("setting")): r for r in report["rows"]}
    measured = [r for r in rows.values() if "not_applicable" not in r]
    assert {r["approximation"] for r in measured} == {"patch statistics", "stale ControlNet", "late LoRA join",
                                                        "CFG parallel", "step caching", "skip-CFG"}
    assert {a for a, _ in rows} - {r["approximation"] for r in measured} == {"patch cache", "cached edits"}
    for off in (rows[("step caching", "0 (First-Block Cache)")], rows[("skip-CFG", "from 1 of the steps")]):
        assert off["default"] and off["identical"] == 1.0  # off: the exact pictures themselves
    skipping = rows[("skip-CFG", "from 0.5 of the steps")]  # from step 1 of 2: its second step unguided
    assert not skipping["default"] and skipping["identical"] < 1.0
    exact_join = rows[("late LoRA join", "0 (joins at step 0 of 2)")]  # the LoRA waited for at step 0: exact
    assert exact_join["psnr_db"] is None and exact_join["ssim"] == 1.0 and exact_join["identical"] == 1.0
    assert exact_join["accuracy_change_points"] == 0 and exact_join["meets_rule"]
    # Exact up to float rounding: per-image statistics, the ControlNet service without staleness, the CFG split.
    for row in (r for r in measured if r["default"] or r["approximation"] == "CFG parallel"):
        assert row["psnr_db"] is None or row["psnr_db"] > 60, row
        assert row["ssim"] > 0.999, row
    assert rows[("CFG parallel", "latent_parallel (rows on 2 ranks)")]["ranks_agree"]
    assert all(0 <= r["prompt_accuracy"] <= 1 for r in measured)
    assert (tmp_path / "fidelity.png").stat().st_size > 0



def test_bench_fidelity_measures_the_patch_cache_and_cached_edits_on_the_sd3_model(tmp_path):
    assert bench_fidelity.main(["--model", "shapes-sd3", "--prompts", "2", "--steps", "3", "--threads", "1",
                                "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fidelity.json").read_text())["rows"]
    measured = {r["approximation"] for r in rows if "not_applicable" not in r}
    assert measured == {"CFG parallel", "step caching", "skip-CFG", "patch cache", "cached edits"}
    assert [r["approximation"] for r in rows if "not_applicable" in r] == ["patch statistics"]
    patch_cache = [r for r in rows if r["approximation"] == "patch cache"]
    assert len(patch_cache) == 2 and all(0 <= r["reused"] <= 1 for r in patch_cache)
    edits = [r for r in rows if r["approximation"] == "cached edits"]
    assert [r["setting"].split()[0] for r in edits] == ["keys_values", "outputs"]
    for r in edits:  # the second edit of a template reuses the first one's activations outside its mask
        assert 0 < r["computed_tokens"] < 1 and r["identical"] < 1 and r["ssim"] > 0.5, r
