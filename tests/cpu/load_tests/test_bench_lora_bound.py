import json
import math

from stepserve.load_tests.bench_lora_bound import bound, main


def test_the_bound_is_the_first_step_below_the_threshold():
    assert bound([0.999, 0.995, 0.98, 0.9], 0.99) == 2
    assert bound([0.999, 0.995], 0.99) == 1  # never below: the last step


def test_the_benchmark_writes_its_json_and_plot(tmp_path):
    assert main(["--steps", "4", "--seeds", "0", "--size", "32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "lora_bound.json").read_text())
    (seed,) = result["seeds"]
    assert len(seed["similarity"]) == 4 and all(0.9 < s <= 1.0 for s in seed["similarity"])
    exact, *late = seed["fidelity"]
    assert exact == {"join_step": 0, "psnr_db": None, "ssim": 1.0}  # identical: JSON has no infinity
    assert late and all(f["psnr_db"] < math.inf and f["ssim"] < 1.0 for f in late)  # joining late changes it
    assert (tmp_path / "lora_bound.png").stat().st_size > 10_000
