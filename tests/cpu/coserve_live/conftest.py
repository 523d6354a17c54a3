import pytest

from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.integration.conftest import serving


@pytest.fixture(scope="package")
def coserve_app():
    """configs/local-video.yaml (tiny-sd images + tiny-wan videos, 2 workers, GenServe) served by a
    real local Ray + Serve on a free port. Its own package: the image app's Ray is gone by now."""
    yield from serving(load_serve_config(CONFIGS / "local-video.yaml"))
