import pytest

from stepserve.engine.families import ALL_PARTS, load_family

from ...tiny import TINY


@pytest.fixture(scope="session")
def tiny_family():
    return load_family(TINY, ALL_PARTS, "cpu")
