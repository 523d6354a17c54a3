"""Each API key is a tenant: its video jobs, Idempotency-Keys and edit templates are its own.
Another tenant's job is unknown (404) to list, get, cancel, delete and download; equal
Idempotency-Keys of two tenants are two requests; handle callers (trusted) see every job."""

import asyncio

import pytest

from stepserve.deployments.api_access import owner_of
from tests.cpu.deployments.fakes import assert_error, build, http_client
from tests.cpu.deployments.test_auth import FOX
from tests.cpu.deployments.test_edits_api import EDITS, body

A, B = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}


@pytest.fixture
def app():
    return build(api_keys=["ka", "kb"])


def test_a_tenant_is_a_digest_of_its_key_never_the_key():
    assert owner_of("ka") != owner_of("kb") and "ka" not in owner_of("ka") and len(owner_of("ka")) == 32


def test_neither_tenant_sees_or_touches_the_others_jobs(app, monkeypatch):
    with http_client(app.ingress, monkeypatch) as http:
        mine = http.post("/v1/videos", json=FOX, headers=A).json()["id"]
        theirs = http.post("/v1/videos", json=FOX, headers=B).json()["id"]
        assert [v["id"] for v in http.get("/v1/videos", headers=A).json()["data"]] == [mine]
        assert [v["id"] for v in http.get("/v1/videos", headers=B).json()["data"]] == [theirs]
        assert_error(http.get("/v1/videos", params={"after": theirs}, headers=A), 400, "invalid_value")
        for method, path in (("GET", ""), ("GET", "/content"), ("POST", "/cancel"), ("DELETE", "")):
            assert_error(http.request(method, f"/v1/videos/{theirs}{path}", headers=A), 404, "video_not_found")
        assert http.get(f"/v1/videos/{theirs}", headers=B).json()["status"] == "queued"  # untouched
        assert app.router.cancelled == []
        assert http.post(f"/v1/videos/{mine}/cancel", headers=A).json()["status"] == "cancelled"
        # A handle caller acts for every tenant.
        listed = asyncio.run(app.ingress.list_videos())
        assert {v["id"] for v in listed["data"]} == {mine, theirs}


def test_equal_idempotency_keys_of_two_tenants_are_two_requests(app, monkeypatch):
    with http_client(app.ingress, monkeypatch) as http:
        key = {"Idempotency-Key": "retry-1"}
        first = http.post("/v1/videos", json=FOX, headers={**A, **key}).json()["id"]
        assert http.post("/v1/videos", json=FOX, headers={**A, **key}).json()["id"] == first  # a retry
        other = http.post("/v1/videos", json=FOX, headers={**B, **key}).json()["id"]
        assert other != first
        # Another body under the same key is a conflict for its own tenant only.
        assert http.post("/v1/videos", json={**FOX, "prompt": "a cat"}, headers={**A, **key}).status_code == 409


def test_each_tenant_has_its_own_templates(monkeypatch):
    app = build(api_keys=["ka", "kb"], **EDITS)
    monkeypatch.setattr("stepserve.deployments.images.ray.put", lambda value: value)
    with http_client(app.ingress, monkeypatch) as http:
        for headers in (A, A, B):
            assert http.post("/v1/images/edits", json=body(model="tiny-sd3", template_id="sofa"),
                             headers=headers).status_code == 200
    a1, a2, b = (call[0].template_id for call in app.router.submit.calls)
    assert a1 == a2 != b and a1.startswith("sofa#") and b.endswith(owner_of("kb"))
