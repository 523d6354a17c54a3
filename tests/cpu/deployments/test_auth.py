"""API-key auth: off without keys; with keys, only `Authorization: Bearer <key>` passes."""

from types import SimpleNamespace

import pytest
from starlette.requests import Request

from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.ingress import Ingress


def request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/images/generations", "headers": raw})


def authorize(keys, headers):
    Ingress._authorize(SimpleNamespace(api_keys=keys), request(headers))


def test_no_keys_means_open():
    authorize((), {})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"},
                                     {"Authorization": "Basic k1"}])
def test_missing_or_wrong_key_is_401(headers):
    with pytest.raises(APIError) as info:
        authorize(("k1", "k2"), headers)
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


def test_any_configured_key_passes():
    authorize(("k1", "k2"), {"Authorization": "Bearer k2"})
    authorize(("k1",), {"authorization": "bearer k1"})


def test_keys_from_environment(monkeypatch):
    monkeypatch.setenv("STEPSERVE_TEST_KEYS", "a, b,,")
    config = AppConfig.model_validate({"models": [{"name": "m", "preset": "tiny"}], "api_keys": ["c"],
                                       "api_keys_env": "STEPSERVE_TEST_KEYS"})
    assert config.resolved_api_keys() == ("c", "a", "b")
