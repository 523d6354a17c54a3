"""API-key auth: off without keys; with keys every route but /health (read from the app) and every
unknown path needs `Authorization: Bearer <key>`; `metrics_api_keys` replace them for /metrics only; keys that could never be checked (empty,
blank, from an unset variable) stop the config from loading."""

from types import SimpleNamespace

import pytest
from starlette.requests import Request

from stepserve.deployments.api_access import ApiAccess, key_digest, owner_of
from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.ingress import Ingress, api_routes
from tests.cpu.deployments.fakes import INGRESS, StoreHandle, assert_error, build, http_client

ENV = "STEPSERVE_TEST_KEYS"
MODELS = [{"name": "m", "preset": "tiny"}]
FOX = {"prompt": "a fox", "num_frames": 5, "size": "32x32"}
KEY = {"Authorization": "Bearer k2"}


def request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/images/generations", "headers": raw})


def authorize(keys, headers):
    digests = tuple(key_digest(k) for k in keys)
    Ingress._authorize(SimpleNamespace(access=ApiAccess(digests, digests)), request(headers))


def test_no_keys_means_open():
    authorize((), {})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"},
                                     {"Authorization": "Basic k1"}, {"Authorization": "Bearer "},
                                     {"Authorization": "Bearer k"}, {"Authorization": "Bearer été"}])
def test_missing_or_wrong_key_is_401(headers):
    with pytest.raises(APIError) as info:
        authorize(("k1", "k2"), headers)
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


def test_any_configured_key_passes():
    authorize(("k1", "k2"), {"Authorization": "Bearer k2"})
    authorize(("k1",), {"authorization": "bearer k1"})
    authorize(("clé",), {"authorization": "Bearer clé"})  # non-ASCII keys compare as bytes


# What an authorized call of each route gets (the job routes act on a live job); the routes
# themselves are read from the app below, so a route added without an entry here fails.
WITH_KEY = {
    ("POST", "/v1/images/generations"): ({"json": {"prompt": "a cat"}}, 200),
    ("POST", "/v1/images/edits"): ({"json": {"prompt": "a cat"}}, 400),  # no image: checked after the key
    ("POST", "/v1/videos"): ({"json": FOX}, 200),
    ("GET", "/v1/videos"): ({}, 200),
    ("GET", "/v1/videos/{video_id}"): ({}, 200),
    ("GET", "/v1/videos/{video_id}/content"): ({}, 409),
    ("POST", "/v1/videos/{video_id}/cancel"): ({}, 200),
    ("DELETE", "/v1/videos/{video_id}"): ({}, 200),
    ("GET", "/v1/models"): ({}, 200),
    ("GET", "/ready"): ({}, 200),
    ("GET", "/metrics"): ({}, 200),
    ("GET", "/openapi.json"): ({}, 200),
    ("GET", "/docs"): ({}, 200),
    # Any other path or method: 404/405 in the OpenAI shape, for a caller with a key only.
    ("GET", "/{path:path}"): ({}, 404),
    ("POST", "/{path:path}"): ({}, 404),
    ("DELETE", "/{path:path}"): ({}, 404),
    ("PUT", "/{path:path}"): ({}, 404),
    ("PATCH", "/{path:path}"): ({}, 404),
    ("OPTIONS", "/{path:path}"): ({}, 404),
    ("HEAD", "/{path:path}"): ({}, 404),
}
OPEN = {("GET", "/health")}


def test_the_table_lists_every_route_the_app_serves():
    served = {(method, route.path) for route in api_routes() for method in route.methods}
    assert served == set(WITH_KEY) | OPEN


def concrete(path: str, vid: str) -> str:
    return path.replace("{video_id}", vid).replace("{path:path}", "v1/no/such/thing")


@pytest.mark.parametrize("method,path", sorted(WITH_KEY), ids=[f"{m} {p}" for m, p in sorted(WITH_KEY)])
def test_with_keys_every_route_but_health_needs_one(monkeypatch, method, path):
    kwargs, status = WITH_KEY[method, path]
    app = build(api_keys=["k1", "k2"])
    with http_client(app.ingress, monkeypatch) as http:
        vid = http.post("/v1/videos", json=FOX, headers=KEY).json()["id"]
        submitted = list(app.router.submitted)
        url = concrete(path, vid)
        for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "k2"}, {"Authorization": "Bearer "}):
            response = http.request(method, url, headers=headers, **kwargs)
            assert response.status_code == 401, (method, url, headers, response.text)
            if method != "HEAD":
                assert_error(response, 401, "invalid_api_key")
        # Refused before any work: nothing reached the router or the text encoder.
        assert app.router.submitted == submitted and app.router.cancelled == []
        assert not app.router.readiness.calls and not app.text_encoder.ready.calls
        assert http.get(f"/v1/videos/{vid}", headers=KEY).json()["status"] == "queued"
        assert http.request(method, url, headers=KEY, **kwargs).status_code == status
        assert http.get("/health").json() == {"status": "ok"}


def test_unknown_paths_and_methods_answer_in_the_openai_shape(http):
    assert_error(http.get("/v1/nothing"), 404, "unknown_url")
    assert_error(http.get("/v1/images/generations"), 405, "method_not_allowed")


def test_open_docs_opens_only_the_docs(monkeypatch):
    app = build(api_keys=["k1"], ingress={"open_docs": True})
    with http_client(app.ingress, monkeypatch) as http:
        schema = http.get("/openapi.json")
        assert schema.status_code == 200 and "/v1/images/generations" in schema.json()["paths"]
        assert http.get("/docs").status_code == 200 and "/openapi.json" in http.get("/docs").text
        assert_error(http.get("/v1/models"), 401, "invalid_api_key")
        assert_error(http.get("/redoc"), 401, "invalid_api_key")  # FastAPI's other page is not served at all


def test_without_keys_every_route_is_open(monkeypatch):
    app = build()
    with http_client(app.ingress, monkeypatch) as http:
        vid = http.post("/v1/videos", json=FOX).json()["id"]
        for (method, path), (kwargs, status) in WITH_KEY.items():
            assert http.request(method, concrete(path, vid), **kwargs).status_code == status, path


def test_metrics_keys_replace_the_main_keys_for_metrics_only(monkeypatch):
    app = build(api_keys=["k1"], metrics_api_keys=["scraper"])
    scraper, user = {"Authorization": "Bearer scraper"}, {"Authorization": "Bearer k1"}
    with http_client(app.ingress, monkeypatch) as http:
        metrics = http.get("/metrics", headers=scraper)
        assert metrics.status_code == 200 and b"stepserve_router_rounds 7" in metrics.content
        assert_error(http.get("/metrics", headers=user), 401, "invalid_api_key")
        assert_error(http.get("/metrics"), 401, "invalid_api_key")
        for path in ("/v1/models", "/ready", "/v1/videos"):
            assert_error(http.get(path, headers=scraper), 401, "invalid_api_key")
            assert http.get(path, headers=user).status_code == 200
        assert_error(http.post("/v1/images/generations", json={"prompt": "a cat"}, headers=scraper), 401,
                     "invalid_api_key")


def test_keys_from_environment(monkeypatch):
    monkeypatch.setenv(ENV, "a, b,,")
    config = AppConfig.model_validate({"models": MODELS, "api_keys": ["c"], "api_keys_env": ENV})
    assert config.resolved_api_keys() == ("c", "a", "b")
    app = build(api_keys_env=ENV)
    with http_client(app.ingress, monkeypatch) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer b"}).status_code == 200
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer c"}), 401, "invalid_api_key")


@pytest.mark.parametrize("field,keys", [
    ("api_keys", [""]), ("api_keys", ["   "]), ("api_keys", ["k1", "\t"]),
    ("metrics_api_keys", [""]), ("metrics_api_keys", [" "]),
])
def test_empty_or_blank_keys_are_refused_at_config_load(field, keys):
    # An empty token would let every request with "Authorization: Bearer " through.
    with pytest.raises(ValueError, match="must not be empty or blank"):
        AppConfig.model_validate({"models": MODELS, "api_keys": ["k1"], field: keys})


@pytest.mark.parametrize("value", [None, "", " , ,"])
def test_api_keys_env_without_keys_is_refused_at_config_load(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"{ENV}.*unset or holds no keys"):
        AppConfig.model_validate({"models": MODELS, "api_keys_env": ENV})
    # Keys listed in the config do not excuse a variable that holds none: it was meant to hold some.
    with pytest.raises(ValueError, match="unset or holds no keys"):
        AppConfig.model_validate({"models": MODELS, "api_keys": ["k1"], "api_keys_env": ENV})


def test_metrics_keys_without_api_keys_are_refused():
    with pytest.raises(ValueError, match="metrics_api_keys without api_keys"):
        AppConfig.model_validate({"models": MODELS, "metrics_api_keys": ["scraper"]})


def test_metrics_keys_with_keys_from_the_environment_load(monkeypatch):
    monkeypatch.setenv(ENV, "a")
    config = AppConfig.model_validate({"models": MODELS, "api_keys_env": ENV, "metrics_api_keys": ["scraper"]})
    assert (config.resolved_api_keys(), config.metrics_api_keys) == (("a",), ["scraper"])


def test_a_replica_whose_environment_lacks_the_keys_checks_them_by_the_builds_digests(monkeypatch):
    """The keys are read where the app is built (Serve's build task on the head, whose environment
    holds them); a replica elsewhere gets their digests only, and checks keys by them."""
    monkeypatch.setenv(ENV, "sk-head-only")
    config = AppConfig.model_validate({"models": MODELS, "api_keys_env": ENV})
    access = ApiAccess.of(config)
    monkeypatch.delenv(ENV)
    assert "sk-head-only" not in repr(access) and access.keys == (key_digest("sk-head-only"),)
    app = build()
    ingress = INGRESS(config, app.router, StoreHandle(app.store), app.text_encoder, access)
    assert ingress._authorize(request({"Authorization": "Bearer sk-head-only"})) == owner_of("sk-head-only")
    with pytest.raises(APIError):
        ingress._authorize(request({"Authorization": "Bearer b"}))
    # Without the build's digests, a replica reads its own environment, which holds none: it refuses.
    with pytest.raises(RuntimeError, match=f"{ENV} held no API keys where the app was built"):
        INGRESS(config, app.router, StoreHandle(app.store), app.text_encoder)