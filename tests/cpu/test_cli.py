"""`stepserve generate` starts the embedded default in-process and writes a PNG with a progress bar."""

import subprocess
import sys

from PIL import Image


def test_generate_writes_png_with_progress(tmp_path):
    out = tmp_path / "fox.png"
    proc = subprocess.run(
        [sys.executable, "-m", "stepserve.cli", "generate", "a red fox", "-o", str(out), "--size", "64x128",
         "--steps", "6", "--seed", "3", "--num-cpus", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Image.open(out).size == (64, 128)
    assert "denoising" in proc.stderr and "6/6" in proc.stderr
    assert "seed 3" in proc.stdout


def test_generate_reports_bad_input_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "stepserve.cli", "generate", "x", "-o", str(tmp_path / "x.png"), "--size", "63x63",
         "--num-cpus", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "size" in proc.stderr and "Traceback" not in proc.stderr
