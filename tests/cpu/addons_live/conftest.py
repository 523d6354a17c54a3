import pytest

from stepserve.runtime import tiny_config_path, load_serve_config

from tests.cpu.integration.conftest import serving


@pytest.fixture(scope="package")
def addons_app():
    """configs/local-tiny.yaml with the ControlNets in their own deployment (ControlNet-as-a-Service)
    and LoRAs that may join a request late (up to half its steps; "ink" by its own bound, never),
    served by a real local Ray + Serve. Its own package: the other apps' Ray is gone by now."""
    config = load_serve_config(tiny_config_path())
    args = config["applications"][0]["args"]
    args["controlnet_service"] = {"enabled": True, "num_cpus": 0.1, "torch_threads": 1, "device": "cpu"}
    args["lora_loading"] = {"join_by": 0.5}
    ink = next(lora for lora in args["loras"] if lora["name"] == "ink")
    ink["join_by"] = 0.0  # its own bound: it may not join late (requests with it wait for it)
    yield from serving(config)
