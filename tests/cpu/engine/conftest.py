import pytest

from stepserve.engine.families import ALL_PARTS, load_family

from ...tiny import TINY, TINY_SDXL


@pytest.fixture(scope="session")
def tiny_family():
    return load_family(TINY, ALL_PARTS, "cpu")


@pytest.fixture(scope="session")
def tiny_sdxl():
    return load_family(TINY_SDXL, ALL_PARTS, "cpu")


@pytest.fixture(params=["tiny_family", "tiny_sdxl"])
def image_family(request):
    """Each text-to-image family's tiny preset, every part loaded."""
    return request.getfixturevalue(request.param)
