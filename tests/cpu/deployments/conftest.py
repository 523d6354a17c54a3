"""The ingress over its test doubles (`fakes.build`): the app, its router, and an HTTP client."""

import pytest

from tests.cpu.deployments.fakes import build, http_client


@pytest.fixture
def app():
    return build()


@pytest.fixture
def router(app):
    return app.router


@pytest.fixture
def http(app, monkeypatch):
    with http_client(app.ingress, monkeypatch) as client:
        yield client
