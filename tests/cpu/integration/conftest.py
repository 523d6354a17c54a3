import contextlib
import copy
import socket
import time

import httpx
import pytest

from stepserve.runtime import tiny_config_path, load_serve_config, run_app, start_local_ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_ray_for_tests():
    """A lean local Ray for one test package; Serve and Ray end with it."""
    import ray
    from ray import serve

    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def serving(config: dict):
    """Serve `config` (a Serve YAML as a dict) on a lean local Ray at a free port until the
    generator is closed; yields (url, ingress handle)."""
    config = copy.deepcopy(config)
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    with local_ray_for_tests():
        handle = run_app(config, http=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "app never became ready"
            time.sleep(0.5)
        yield url, handle


@pytest.fixture(scope="package")
def live_app():
    """configs/local-tiny.yaml served by a real local Ray + Serve, on a free port."""
    yield from serving(load_serve_config(tiny_config_path()))
