"""The API keys live only where the app is built. On KubeRay, Serve builds the app in a task on
the head, whose environment holds the keys from a Secret; the ingress replicas run on other pods
that need not hold them. Here the build runs in a Ray task whose environment alone has the keys,
and the app it returns is served by replicas whose environment lacks them: they check keys by the
digests the build made, and the served app holds no key."""

import os
import time

import httpx
import ray
from ray import serve

from stepserve.runtime import load_serve_config, tiny_config_path

from tests.cpu.integration.conftest import free_port, local_ray_for_tests

ENV = "STEPSERVE_API_KEYS"
KEY = "sk-only-on-the-head"
FOX = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2}


@ray.remote
def build_where_the_keys_are(args: dict):
    from stepserve.deployments.app import build_app

    assert os.environ[ENV] == KEY
    return build_app(args)


def test_an_app_built_where_the_keys_are_serves_from_replicas_without_them():
    assert ENV not in os.environ  # nor, then, in any replica this test's Ray starts
    (app,) = load_serve_config(tiny_config_path())["applications"]
    args = {**app["args"], "api_keys_env": ENV}
    port = free_port()
    with local_ray_for_tests():
        built = ray.get(build_where_the_keys_are.options(runtime_env={"env_vars": {ENV: KEY}}).remote(args))
        assert KEY.encode() not in ray.cloudpickle.dumps(built)  # what the replicas get: digests only
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(built, name="stepserve", route_prefix="/")
        url, key = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/ready", headers=key, timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "app never became ready"
            time.sleep(0.5)
        assert httpx.post(f"{url}/v1/images/generations", json=FOX, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert httpx.post(f"{url}/v1/images/generations", json=FOX, headers=wrong, timeout=60).status_code == 401
        served = httpx.post(f"{url}/v1/images/generations", json=FOX, headers=key, timeout=120)
        assert served.status_code == 200 and served.json()["data"][0]["b64_json"]
