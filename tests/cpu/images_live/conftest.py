import pytest

from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.integration.conftest import serving


@pytest.fixture(scope="package")
def images_app():
    """configs/local-images.yaml (every tiny text-to-image family, 2 workers, continuous batching)
    served by a real local Ray + Serve on a free port. Its own package: the other apps' Ray is
    gone by now."""
    yield from serving(load_serve_config(CONFIGS / "local-images.yaml"))
