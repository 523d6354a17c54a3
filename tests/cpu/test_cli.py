"""`stepserve generate` runs the server's engine in this process (no Ray, no Serve) and writes a PNG
with a progress bar, or asks a running server with --url; `stepserve serve` serves a config until
Ctrl-C."""

import base64
import io
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import yaml
from PIL import Image

from stepserve.cli import main
from stepserve.oneshot import app_config, load_model, run_request, validate
from stepserve.runtime import default_config_path, load_serve_config

from tests.tiny import solo_pipeline_image


def _generate(*args: str) -> subprocess.CompletedProcess:
    """`stepserve generate ARGS` as its own process (so it exits as the command does)."""
    return subprocess.run([sys.executable, "-m", "stepserve.cli", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _assert_same_picture(png: bytes, expected: np.ndarray) -> None:
    """Equal pixels, but for a float difference that rounds a channel the other way (within 1/255)."""
    actual = _pixels(png)
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= 1
    assert (actual != expected).mean() < 0.01


def _assert_quiet(proc: subprocess.CompletedProcess) -> None:
    """Nothing but the progress bar on stderr: no library warnings, no traceback, no Ray."""
    for noise in ("WARNING", "Traceback", "[transformers]"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert "ray" not in proc.stderr.lower(), proc.stderr[-3000:]


def test_generate_writes_the_solo_pipelines_png_with_progress_and_one_line(tmp_path):
    out = tmp_path / "fox.png"
    proc = _generate("a red fox", "-o", str(out), "--size", "64x128", "--steps", "6", "--seed", "3",
                     "--negative-prompt", "blurry")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"wrote {out} (seed 3)"]
    assert "denoising" in proc.stderr and "6/6" in proc.stderr
    _assert_quiet(proc)
    # The default config's model run alone by diffusers' own pipeline, same seed: what the server
    # returns too (the engine's golden tests hold its continuous batches to the same pipeline).
    app = app_config(load_serve_config(default_config_path()))
    spec = validate(app, {"prompt": "a red fox", "size": "64x128", "num_inference_steps": 6, "seed": 3,
                          "negative_prompt": "blurry"})
    family = load_model(app.model(spec.model), "cpu")
    expected = (solo_pipeline_image(family, spec) * 255).round().astype(np.int16)  # as diffusers' numpy_to_pil
    _assert_same_picture(out.read_bytes(), expected)
    assert Image.open(out).size == (64, 128)


def test_one_shot_steps_the_worker_engine_with_progress():
    """In process: every step reported once, and the PNG the worker's runner finishes the request into."""
    app = app_config(load_serve_config(default_config_path()))
    spec = validate(app, {"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 3, "seed": 5})
    family = load_model(app.model(spec.model), "cpu")
    seen = []
    png = run_request(family, spec, lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    expected = (solo_pipeline_image(family, spec) * 255).round().astype(np.int16)
    _assert_same_picture(png, expected)


def test_generate_reports_bad_input_without_traceback(tmp_path):
    proc = _generate("x", "-o", str(tmp_path / "x.png"), "--size", "63x63")
    assert proc.returncode == 2
    assert "size" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "x.png").exists()


def test_generate_passes_the_approximations_it_is_asked_for(tmp_path, capsys):
    """--skip-cfg-quality reaches validation as the body field: below the model's floor it is refused."""
    code = main(["generate", "x", "-o", str(tmp_path / "x.png"), "--skip-cfg-quality", "0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "skip_cfg_quality" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def _config_with(tmp_path, **args) -> str:
    """The default config with these application args changed, written as a YAML file."""
    config = load_serve_config(default_config_path())
    config["applications"][0]["args"].update(args)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_generate_refuses_a_video_model_and_points_at_the_server(tmp_path, capsys):
    app = load_serve_config(default_config_path())["applications"][0]["args"]
    wan = {"name": "tiny-wan", "family": "wan", "preset": "tiny", "default_size": "64x64", "max_size": 128,
           "default_num_frames": 9, "max_num_frames": 17}
    config = _config_with(tmp_path, models=[*app["models"], wan])
    code = main(["generate", "a boat", "--config", config, "--model", "tiny-wan", "-o", str(tmp_path / "v.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert "tiny-wan" in err and "stepserve serve" in err and "Traceback" not in err
    assert not (tmp_path / "v.png").exists()


def test_one_shot_ignores_auth_it_has_no_edge_for(tmp_path, monkeypatch):
    """A config that names an API key variable unset here still validates: there is no HTTP edge."""
    monkeypatch.delenv("STEPSERVE_TEST_UNSET_KEYS", raising=False)
    app = app_config(load_serve_config(_config_with(tmp_path, api_keys_env="STEPSERVE_TEST_UNSET_KEYS")))
    assert validate(app, {"prompt": "a fox"}).model == app.models[0].name


class _FakeServer(ThreadingHTTPServer):
    """Answers POST /v1/images/generations with `answer` (status, body) and keeps what it was sent."""

    def __init__(self, answer: tuple[int, dict]):
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.answer = answer
        self.requests: list[tuple[str, dict, dict]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FakeHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))
        status, answer = self.server.answer
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep the test output clean
        pass


def _serving(answer: tuple[int, dict]) -> _FakeServer:
    server = _FakeServer(answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_generate_url_posts_the_request_and_writes_the_answer(tmp_path, capsys, monkeypatch):
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(png, format="PNG")
    server = _serving((200, {"created": 0, "data": [{"b64_json": base64.b64encode(png.getvalue()).decode(),
                                                       "seed": 9}]}))
    monkeypatch.setenv("STEPSERVE_API_KEY", "sk-test")
    out = tmp_path / "remote.png"
    try:
        code = main(["generate", "a red fox", "--url", server.url + "/", "-o", str(out), "--steps", "4",
                     "--seed", "9", "--size", "64x64"])
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.splitlines() == [f"wrote {out} (seed 9)"]
    assert out.read_bytes() == png.getvalue()
    ((path, headers, body),) = server.requests
    assert path == "/v1/images/generations"
    assert headers["Authorization"] == "Bearer sk-test"
    assert body == {"prompt": "a red fox", "n": 1, "response_format": "b64_json", "num_inference_steps": 4,
                    "seed": 9, "size": "64x64"}


def test_generate_url_reports_the_servers_error(tmp_path, capsys):
    error = {"error": {"message": "size must be a multiple of 8", "type": "invalid_request_error", "param": "size",
                       "code": "invalid_value"}}
    server = _serving((400, error))
    try:
        code = main(["generate", "x", "--url", server.url, "--api-key", "", "-o", str(tmp_path / "x.png")])
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == "" and "Traceback" not in captured.err
    assert "size must be a multiple of 8" in captured.err and "param: size" in captured.err
    ((_, headers, _),) = server.requests
    assert "Authorization" not in headers  # an empty key sends none


def test_serve_answers_the_openai_client_and_stops_on_ctrl_c(tmp_path):
    """The README's first command: `stepserve serve configs/local.yaml` (on a free port here); then
    `stepserve generate --url` asks it, and the one-shot `stepserve generate` draws the same picture."""
    import signal
    import socket
    import time

    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = load_serve_config(default_config_path())
    config["http_options"] = {"host": "192.0.2.1", "port": port}  # (a documentation address: --host replaces it)
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "stepserve.cli", "serve", str(path), "--num-cpus", "2",
                             "--host", "127.0.0.1"],
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
        image = client.images.generate(model="shapes", prompt="a red circle on a white background", size="64x128",
                                       response_format="b64_json", extra_body={"num_inference_steps": 4})
        assert Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json))).size == (64, 128)

        request = ["a blue star on a yellow background", "--size", "64x128", "--steps", "4", "--seed", "11",
                   "--model", "shapes"]
        served = _generate(*request, "--url", f"http://127.0.0.1:{port}", "-o", str(tmp_path / "served.png"))
        assert served.returncode == 0, served.stderr[-3000:]
        assert served.stdout.splitlines() == [f"wrote {tmp_path / 'served.png'} (seed 11)"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    here = _generate(*request, "--config", str(path), "-o", str(tmp_path / "here.png"))
    assert here.returncode == 0, here.stderr[-3000:]
    _assert_same_picture((tmp_path / "here.png").read_bytes(), _pixels((tmp_path / "served.png").read_bytes()))
