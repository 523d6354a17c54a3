import pytest

from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.integration.conftest import serving


@pytest.fixture(scope="package")
def wan22_app():
    """configs/local-wan22.yaml (tiny Wan 2.2 T2V-A14B and TI2V-5B, 2 workers, continuous batching)
    served by a real local Ray + Serve on a free port. Its own package: the other apps' Ray is
    gone by now."""
    yield from serving(load_serve_config(CONFIGS / "local-wan22.yaml"))
