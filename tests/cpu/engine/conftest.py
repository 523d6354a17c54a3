import pytest

from stepserve.engine.families import ALL_PARTS, load_family

from tests.tiny import TINY, TINY_FLUX, TINY_SD3, TINY_SDXL


@pytest.fixture(scope="session")
def tiny_family():
    return load_family(TINY, ALL_PARTS, "cpu")


@pytest.fixture(scope="session")
def tiny_sdxl():
    return load_family(TINY_SDXL, ALL_PARTS, "cpu")


@pytest.fixture(scope="session")
def tiny_sd3():
    return load_family(TINY_SD3, ALL_PARTS, "cpu")


@pytest.fixture(scope="session")
def tiny_flux():
    return load_family(TINY_FLUX, ALL_PARTS, "cpu")


@pytest.fixture(params=["tiny_family", "tiny_sdxl", "tiny_sd3", "tiny_flux"])
def image_family(request):
    """Each text-to-image family's tiny preset, every part loaded."""
    return request.getfixturevalue(request.param)
