import pytest

from stepserve.runtime import tiny_config_path, load_serve_config

from tests.cpu.integration.conftest import serving


@pytest.fixture(scope="package")
def latent_app():
    """configs/local-tiny.yaml under the latent-parallel policy (its CPU profile prices a split step at
    about half of a whole one), served by a real local Ray + Serve: the two workers join a gloo
    world. Its own package: the other apps' Ray is gone by now."""
    config = load_serve_config(tiny_config_path())
    router = config["applications"][0]["args"]["router"]
    router["policy"], router["profiles"] = "latent_parallel", ["tiny-sd-cpu"]
    yield from serving(config)
