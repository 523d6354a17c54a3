"""The /v1/videos job API of the ingress, over HTTP (httpx, the openai client) and as handle methods.

The router here is a test double: an in-process fake of the three router methods the ingress
calls (`submit_video`, `video_status`, `video_frames`), whose jobs move only when a test says so.
The real router is exercised by the integration tests.
"""

import asyncio
import io
import time
import warnings
from types import SimpleNamespace

import av
import numpy as np
import pytest
import ray.serve
from fastapi.testclient import TestClient

from stepserve.actors.router_core import DuplicateRequestError, QueueFullError
from stepserve.deployments import ingress as ingress_module
from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.video_validation import VideoCreateRequest

CONFIG = {
    "models": [
        {"name": "tiny-sd", "preset": "tiny", "default_size": "128x128", "max_size": 512},
        {"name": "tiny-wan", "family": "wan", "preset": "tiny", "default_size": "64x64", "min_size": 16,
         "max_size": 128, "max_pixels": 128 * 128, "default_steps": 4, "max_steps": 20, "default_guidance_scale": 5.0,
         "default_num_frames": 9, "max_num_frames": 17, "default_fps": 8, "max_fps": 30},
    ],
    "router": {"policy": "genserve", "profiles": ["tiny-sd-cpu"]},
    "limits": {"max_body_bytes": 4096},
}


class _Method:
    """`router.method.remote(...)` as a DeploymentHandle call: an awaitable result."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class FakeVideoRouter:
    """Test double of the router's video methods; the test scripts each job's lifecycle."""

    def __init__(self):
        self.specs, self.jobs, self.frames = {}, {}, {}
        self.refuse: Exception | None = None
        self.frame_calls = 0
        self.submit_video = _Method(self._submit)
        self.video_status = _Method(lambda vid: dict(self.jobs[vid]) if vid in self.jobs else None)
        self.video_frames = _Method(self._frames)

    def _submit(self, spec):
        if self.refuse is not None:
            raise self.refuse
        if spec.request_id in self.jobs:
            raise DuplicateRequestError(spec.request_id)
        self.specs[spec.request_id] = spec
        self.jobs[spec.request_id] = {
            "status": "queued", "steps_done": 0, "steps_total": spec.num_inference_steps, "error": None,
            "created_at": time.time(), "completed_at": None, "paused": False, "sp_degree": 1,
        }

    def _frames(self, vid):
        self.frame_calls += 1
        return self.frames.get(vid)

    def step(self, vid, steps=1):
        job = self.jobs[vid]
        job.update(status="in_progress", steps_done=min(job["steps_total"], job["steps_done"] + steps))

    def complete(self, vid):
        spec = self.specs[vid]
        shape = (spec.num_frames, spec.height, spec.width, 3)
        self.frames[vid] = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        self.jobs[vid].update(status="completed", steps_done=spec.num_inference_steps, completed_at=time.time())

    def fail(self, vid, message):
        self.jobs[vid].update(status="failed", error=message, completed_at=time.time())


# The class as written, under Serve's ASGI wrapper (whose async __init__/__del__ need a replica).
INGRESS = next(c for c in ingress_module.Ingress.__mro__ if "http_generate" in vars(c))


def make_ingress(router, **overrides):
    return INGRESS(AppConfig.model_validate({**CONFIG, **overrides}), router, None)


@pytest.fixture
def router():
    return FakeVideoRouter()


@pytest.fixture
def http(router, monkeypatch):
    """HTTP against the real FastAPI app; Serve's class-based routes find their `self` through
    `serve.get_replica_context().servable_object`, which is pointed at an ingress built here."""
    instance = make_ingress(router)
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=instance))
    with TestClient(ingress_module.api, raise_server_exceptions=False) as client:
        yield client


def assert_error(response, status, code, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_job_lifecycle_over_http(http, router):
    created = http.post("/v1/videos", json={"prompt": "a fox in snow", "model": "tiny-wan", "size": "64x48",
                                            "seconds": "1", "num_inference_steps": 4, "seed": 7})
    assert created.status_code == 200, created.text
    video = created.json()
    vid = video["id"]
    assert vid.startswith("video_") and video["object"] == "video" and video["status"] == "queued"
    assert (video["model"], video["size"], video["num_frames"], video["fps"], video["seconds"]) == (
        "tiny-wan", "64x48", 9, 8, "1.125")
    assert (video["progress"], video["steps_done"], video["steps_total"], video["error"]) == (0, 0, 4, None)
    assert isinstance(video["created_at"], int) and video["completed_at"] is None and video["seed"] == 7
    spec = router.specs[vid]
    assert (spec.width, spec.height, spec.num_frames, spec.fps, spec.seed) == (64, 48, 9, 8, 7)

    assert http.get(f"/v1/videos/{vid}").json()["status"] == "queued"
    assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_not_ready", "video_id")

    router.step(vid, 2)
    polled = http.get(f"/v1/videos/{vid}").json()
    assert (polled["status"], polled["progress"], polled["steps_done"]) == ("in_progress", 50, 2)
    router.step(vid, 2)  # every step done, still decoding: not yet 100
    assert http.get(f"/v1/videos/{vid}").json()["progress"] == 99
    error = assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_not_ready")
    assert "in_progress" in error["message"]

    router.complete(vid)
    done = http.get(f"/v1/videos/{vid}").json()
    assert (done["status"], done["progress"], done["steps_done"]) == ("completed", 100, 4)
    assert isinstance(done["completed_at"], int)

    content = http.get(f"/v1/videos/{vid}/content")
    assert content.status_code == 200
    assert content.headers["content-type"] == "video/mp4" and content.headers["x-stepserve-video-format"] == "mp4"
    with av.open(io.BytesIO(content.content)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
    # A second download is served from the ingress's cache, not re-fetched and re-encoded.
    assert http.get(f"/v1/videos/{vid}/content").content == content.content and router.frame_calls == 1


def test_failed_job(http, router):
    vid = http.post("/v1/videos", json={"prompt": "a fox"}).json()["id"]
    router.step(vid)
    router.fail(vid, "worker died")
    video = http.get(f"/v1/videos/{vid}").json()
    assert video["status"] == "failed"
    assert video["error"] == {"code": "generation_failed", "message": "worker died"}
    error = assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_failed")
    assert "worker died" in error["message"]


def test_unknown_videos_are_404(http, router):
    for vid in ("video_" + "0" * 32, "nope", "video_../../etc"):
        assert_error(http.get(f"/v1/videos/{vid}"), 404, "video_not_found", "video_id")
        assert_error(http.get(f"/v1/videos/{vid}/content"), 404, "video_not_found")


def test_only_the_video_variant_is_served(http, router):
    vid = http.post("/v1/videos", json={"prompt": "a fox"}).json()["id"]
    router.complete(vid)
    assert_error(http.get(f"/v1/videos/{vid}/content", params={"variant": "thumbnail"}), 400,
                 "unsupported_value", "variant")
    assert http.get(f"/v1/videos/{vid}/content", params={"variant": "video"}).status_code == 200


def test_form_bodies_as_openai_clients_send_them(http, router):
    form = {"prompt": "a fox", "model": "tiny-wan", "seconds": "2", "fps": "8", "seed": "3", "size": "32x32"}
    response = http.post("/v1/videos", files={k: (None, v) for k, v in form.items()})  # multipart/form-data
    assert response.status_code == 200, response.text
    assert (response.json()["num_frames"], response.json()["size"], response.json()["seed"]) == (17, "32x32", 3)
    assert http.post("/v1/videos", data={"prompt": "a fox", "num_frames": "5"}).json()["num_frames"] == 5
    upload = http.post("/v1/videos", data={"prompt": "a fox"}, files={"input_reference": ("a.png", b"x", "image/png")})
    assert_error(upload, 400, "unsupported_value", "input_reference")


def test_openai_client(http, router):
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the client flags its Sora methods
        video = client.videos.create(model="tiny-wan", prompt="a fox", size="64x64", seconds="1",
                                     extra_body={"num_inference_steps": 2})
        assert (video.status, video.size, video.progress) == ("queued", "64x64", 0)
        router.complete(video.id)
        assert client.videos.retrieve(video.id).status == "completed"
        data = client.videos.download_content(video.id).read()
    with av.open(io.BytesIO(data)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 9


@pytest.mark.parametrize("body,status,code,param", [
    ({"prompt": "a fox", "model": "sora-2"}, 404, "model_not_found", "model"),
    ({"prompt": "a fox", "model": "tiny-sd"}, 400, "unsupported_model", "model"),
    ({"prompt": "a fox", "size": "72x72"}, 400, "invalid_value", "size"),
    ({"prompt": "a fox", "num_frames": 8}, 400, "invalid_value", "num_frames"),
    ({"prompt": "a fox", "seconds": "60"}, 400, "invalid_value", "seconds"),
    ({"prompt": "a fox", "num_inference_steps": 1000}, 400, "invalid_value", "num_inference_steps"),
    ({"prompt": "a fox", "fps": 1000}, 400, "invalid_value", "fps"),
    ({"prompt": 5}, 400, "invalid_value", "prompt"),
    ({"prompt": "a fox", "extra": 1}, 400, "invalid_value", "extra"),
])
def test_bad_requests_get_openai_errors(http, router, body, status, code, param):
    assert_error(http.post("/v1/videos", json=body), status, code, param)
    assert not router.jobs  # nothing reached the router


def test_malformed_and_oversized_bodies(http, router):
    headers = {"content-type": "application/json"}
    assert_error(http.post("/v1/videos", content=b"{not json", headers=headers), 400, "invalid_json")
    assert_error(http.post("/v1/videos", content=b"[1]", headers=headers), 400, "invalid_json")
    huge = {"prompt": "x" * 5000}
    assert_error(http.post("/v1/videos", json=huge), 413, "request_too_large")
    assert_error(http.post("/v1/videos", data={"prompt": "x" * 5000}), 413, "request_too_large")
    assert not router.jobs


def test_router_refusals_map_to_api_errors(http, router):
    router.refuse = QueueFullError("full")
    error = assert_error(http.post("/v1/videos", json={"prompt": "a fox"}), 429, "queue_full")
    assert http.post("/v1/videos", json={"prompt": "a fox"}).json()["error"]["type"] == "rate_limit_error"
    router.refuse = DuplicateRequestError("dup")
    assert_error(http.post("/v1/videos", json={"prompt": "a fox"}), 409, "duplicate_request_id")
    assert error["message"]


def test_video_model_on_the_image_route_is_400(http):
    response = http.post("/v1/images/generations", json={"prompt": "a cat", "model": "tiny-wan"})
    assert_error(response, 400, "unsupported_model", "model")


def test_models_lists_image_and_video_models(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-sd", "tiny-wan"]


def test_auth_covers_the_video_routes(router, monkeypatch):
    instance = make_ingress(router, api_keys=["k1"])
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=instance))
    with TestClient(ingress_module.api) as client:
        assert_error(client.post("/v1/videos", json={"prompt": "a fox"}), 401, "invalid_api_key")
        assert_error(client.get("/v1/videos/video_" + "0" * 32), 401, "invalid_api_key")
        assert_error(client.get("/v1/videos/video_" + "0" * 32 + "/content"), 401, "invalid_api_key")
        ok = client.post("/v1/videos", json={"prompt": "a fox"}, headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200


def test_handle_methods_share_the_http_code(router):
    ingress = make_ingress(router)

    async def scenario():
        video = await ingress.create_video({"prompt": "a fox", "num_frames": 5, "size": "32x32"})
        typed = await ingress.create_video(VideoCreateRequest(prompt="a hare", seconds=1, fps=8))
        assert (video["status"], video["num_frames"], typed["num_frames"]) == ("queued", 5, 9)
        with pytest.raises(APIError) as info:
            await ingress.video_content(video["id"])
        assert (info.value.status, info.value.code) == (409, "video_not_ready")
        router.complete(video["id"])
        assert (await ingress.get_video(video["id"]))["status"] == "completed"
        data = await ingress.video_content(video["id"])
        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
        with pytest.raises(APIError) as info:
            await ingress.get_video("video_" + "f" * 32)
        assert info.value.status == 404
        with pytest.raises(APIError) as info:
            await ingress.create_video({"prompt": "a fox", "size": "33x33"})
        assert (info.value.status, info.value.param) == (400, "size")
        router.refuse = QueueFullError("full")
        with pytest.raises(APIError) as info:
            await ingress.create_video({"prompt": "a fox"})
        assert info.value.status == 429

    asyncio.run(scenario())


def test_jobs_created_elsewhere_are_still_served(router):
    # Another ingress replica created the job: the status and the file are served, the request
    # fields this replica never saw are null.
    creator, other = make_ingress(router), make_ingress(router)

    async def scenario():
        vid = (await creator.create_video({"prompt": "a fox", "num_frames": 5}))["id"]
        router.complete(vid)
        video = await other.get_video(vid)
        assert (video["status"], video["progress"], video["model"], video["size"]) == ("completed", 100, None, None)
        assert (await other.video_content(vid))[4:8] == b"ftyp"

    asyncio.run(scenario())
