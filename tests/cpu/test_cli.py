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


def test_serve_answers_the_openai_client_and_stops_on_ctrl_c(tmp_path):
    """The README's first command: `stepserve serve configs/local.yaml` (on a free port here)."""
    import base64
    import io
    import signal
    import socket
    import time

    import httpx
    import openai
    import yaml

    from stepserve.runtime import default_config_path, load_serve_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = load_serve_config(default_config_path())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "stepserve.cli", "serve", str(path), "--num-cpus", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        image = client.images.generate(model="tiny-sd", prompt="a lighthouse", size="64x128",
                                       response_format="b64_json", extra_body={"num_inference_steps": 4})
        assert Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json))).size == (64, 128)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
