import pytest

from stepserve.runtime import CONFIGS, load_serve_config

from ..integration.conftest import serving


@pytest.fixture(scope="package")
def sdxl_app():
    """configs/local-sdxl.yaml (tiny-sd and tiny-sdxl, 2 workers, continuous batching) served by a
    real local Ray + Serve on a free port. Its own package: the other apps' Ray is gone by now."""
    yield from serving(load_serve_config(CONFIGS / "local-sdxl.yaml"))
