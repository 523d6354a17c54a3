import json

from stepserve.load_tests.bench_patch_cache import main


def test_the_benchmark_writes_its_json_and_plot(tmp_path):
    """The tiny preset, small sizes: every figure is there and says what the mechanism does."""
    assert main(["--preset", "tiny", "--size", "128", "--calibrate-size", "128", "--steps", "4", "--side", "2",
                 "--tolerances", "1e-3", "1e-2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "patch_cache.json").read_text())
    assert result["exact_matches_reference"] and result["never_reuse_matches_reference"]
    # requests x rows x blocks x patches (8 x 8 tokens) x comparisons (steps 2, 3, 4 against 1, 2, 3 earlier ones)
    assert result["train_samples"] == 2 * 2 * 2 * 16 * (1 + 2 + 3)
    loose, tight = sorted(result["results"], key=lambda r: -r["tolerance"])
    for r in (loose, tight):
        assert len(r["reuse_share_per_step"]) == 4 and r["reuse_share_per_step"][0] == 0.0
        assert 0.5 < r["held_out_score"]["accuracy"] <= 1.0 and r["generation_s"] > 0
    assert loose["reuse_share"] >= tight["reuse_share"]
    assert loose["reuse_share"] > 0 and 0 < loose["ssim"] < 1.0 and loose["latents_rel_l2"] > 0
    assert (tmp_path / "patch_cache.png").stat().st_size > 10_000
