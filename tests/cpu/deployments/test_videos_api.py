"""The /v1/videos job API of the ingress, over HTTP (TestClient, the openai client) and as handle methods.

The router is a test double whose jobs move only when a test says (the real router runs in the
live integration tests); the job store is the real `JobStore`, on a clock the test moves.
"""

import asyncio
import io
import warnings
import zipfile

import av
import numpy as np
import pytest
import ray.exceptions
from PIL import Image

from stepserve.actors.router import MAX_RESUMES
from stepserve.deployments.errors import APIError
from stepserve.deployments.video_validation import VideoCreateRequest
from stepserve.deployments.videos import preferred_wait_s
from stepserve.policies.admission import ClassLoad
from stepserve.policies.types import RequestKind
from stepserve.routing.core import DuplicateRequestError, QueueFullError
from tests.cpu.deployments.fakes import (
    ManualClock,
    assert_error,
    build,
    http_client,
    settle,
    video_frames,
    wait_until,
)

UNKNOWN = "video_" + "0" * 32
FOX = {"prompt": "a fox", "num_frames": 5, "size": "32x32"}


def create(http, body=FOX, **kwargs):
    response = http.post("/v1/videos", json=body, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def decode_mp4(data):
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_job_lifecycle_over_http(app, http, router):
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
    assert (spec.kind, spec.width, spec.height, spec.num_frames, spec.fps, spec.seed) == (
        RequestKind.T2V, 64, 48, 9, 8, 7)

    assert http.get(f"/v1/videos/{vid}").json()["status"] == "queued"
    assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_not_ready", "video_id")

    router.step(vid, 2, sp_degree=2)
    polled = http.get(f"/v1/videos/{vid}").json()
    assert (polled["status"], polled["progress"], polled["steps_done"], polled["sp_degree"]) == (
        "in_progress", 50, 2, 2)
    router.step(vid, 2, status="decoding")  # every step done, still decoding: not yet 100
    polled = http.get(f"/v1/videos/{vid}").json()
    assert (polled["status"], polled["progress"]) == ("in_progress", 99)
    error = assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_not_ready")
    assert "in_progress" in error["message"]

    assert router.finish(vid)
    done = http.get(f"/v1/videos/{vid}").json()
    assert (done["status"], done["progress"], done["steps_done"], done["sp_degree"]) == ("completed", 100, 4, 0)
    assert isinstance(done["completed_at"], int)

    content = http.get(f"/v1/videos/{vid}/content")
    assert content.status_code == 200
    assert content.headers["content-type"] == "video/mp4" and content.headers["x-stepserve-video-format"] == "mp4"
    frames = decode_mp4(content.content)
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
    # A second download is served from the ingress's cache, not fetched and encoded again.
    assert http.get(f"/v1/videos/{vid}/content").content == content.content
    assert len(app.ingress.videos.store.content.calls) == 1


def test_a_paused_video_polls_as_in_progress(http, router):
    vid = create(http)["id"]
    router.step(vid, 1, status="paused", pauses=1)
    video = http.get(f"/v1/videos/{vid}").json()
    assert (video["status"], video["pauses"], video["steps_done"]) == ("in_progress", 1, 1)


def test_frames_variant_is_a_zip_of_the_exact_frames(http, app):
    vid = create(http)["id"]
    app.router.finish(vid)
    response = http.get(f"/v1/videos/{vid}/content", params={"variant": "frames"})
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    assert response.headers["x-stepserve-video-format"] == "png-zip"
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        names = sorted(archive.namelist())
        got = np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB")) for n in names])
    np.testing.assert_array_equal(got, video_frames(app.router.specs[vid]))  # lossless, in order


def decode_image(response, media_type, image_format):
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == media_type
    assert response.headers["x-stepserve-video-format"] == image_format.lower()
    image = Image.open(io.BytesIO(response.content))
    assert image.format == image_format
    return np.asarray(image.convert("RGB")).astype(int)


def nearest_frame(image, frames):
    """Which frame a lossily encoded image shows: the harness's frames are independent noise,
    so the right one is far nearer than any other."""
    return int(np.argmin([np.abs(image - frame.astype(int)).mean() for frame in frames]))


def test_thumbnail_is_the_first_frame_as_webp(http, app):
    vid = create(http, {"prompt": "a fox", "num_frames": 5, "size": "48x32"})["id"]
    app.router.finish(vid)
    image = decode_image(http.get(f"/v1/videos/{vid}/content", params={"variant": "thumbnail"}),
                         "image/webp", "WEBP")
    assert image.shape == (32, 48, 3)  # the video's own size
    assert nearest_frame(image, video_frames(app.router.specs[vid])) == 0


def test_spritesheet_is_a_grid_of_the_frames_as_jpeg(http, app):
    vid = create(http, {"prompt": "a fox", "num_frames": 9, "size": "48x32"})["id"]
    app.router.finish(vid)
    sheet = decode_image(http.get(f"/v1/videos/{vid}/content", params={"variant": "spritesheet"}),
                         "image/jpeg", "JPEG")
    assert sheet.shape == (3 * 32, 3 * 48, 3)  # 9 frames: 3x3 tiles at the video's size
    frames = video_frames(app.router.specs[vid])
    tiles = [sheet[r * 32:(r + 1) * 32, c * 48:(c + 1) * 48] for r in range(3) for c in range(3)]
    assert [nearest_frame(tile, frames) for tile in tiles] == list(range(9))  # in time order


def test_unknown_variant_is_400_naming_every_variant(http, app):
    vid = create(http)["id"]
    app.router.finish(vid)
    error = assert_error(http.get(f"/v1/videos/{vid}/content", params={"variant": "poster"}), 400,
                         "unsupported_value", "variant")
    assert all(f"'{v}'" in error["message"] for v in ("video", "thumbnail", "spritesheet", "frames"))


@pytest.mark.parametrize("variant", ["thumbnail", "spritesheet"])
def test_previews_of_an_unfinished_job_are_409(http, router, variant):
    running, failed = create(http)["id"], create(http)["id"]
    router.step(running, 1)
    router.fail(failed)
    assert_error(http.get(f"/v1/videos/{running}/content", params={"variant": variant}), 409, "video_not_ready")
    assert_error(http.get(f"/v1/videos/{failed}/content", params={"variant": variant}), 409, "video_failed")


def test_every_variant_is_cached_then_dropped_with_its_job(http, app):
    vid = create(http)["id"]
    app.router.finish(vid)
    variants = ("video", "thumbnail", "spritesheet", "frames")
    first = [http.get(f"/v1/videos/{vid}/content", params={"variant": v}).content for v in variants]
    assert [http.get(f"/v1/videos/{vid}/content", params={"variant": v}).content for v in variants] == first
    assert len(app.ingress.videos.store.content.calls) == 4  # one fetch per variant, none for the repeats
    assert http.delete(f"/v1/videos/{vid}").json()["deleted"] is True
    assert not [key for key in app.ingress.videos._files if key.startswith(vid)]


def test_expires_at_is_the_ttl_past_the_end(monkeypatch):
    clock = ManualClock(1_000.25)
    app = build(clock, jobs={"ttl_s": 60})
    with http_client(app.ingress, monkeypatch) as http:
        created = create(http)
        completed, failed, cancelled, live = created["id"], create(http)["id"], create(http)["id"], create(http)["id"]
        assert created["expires_at"] is None
        app.router.finish(completed)
        clock.now += 10
        app.router.fail(failed)
        clock.now += 10
        http.post(f"/v1/videos/{cancelled}/cancel")
        app.router.step(live, 1)
        for vid, ended_at in ((completed, 1_000.25), (failed, 1_010.25), (cancelled, 1_020.25)):
            video = http.get(f"/v1/videos/{vid}").json()
            assert video["expires_at"] == int(ended_at + 60) == video["completed_at"] + 60, video
        # Nothing of a live job expires, queued or running.
        assert http.get(f"/v1/videos/{live}").json()["expires_at"] is None
        listed = {v["id"]: v["expires_at"] for v in http.get("/v1/videos").json()["data"]}
        assert listed == {completed: 1_060, failed: 1_070, cancelled: 1_080, live: None}
        # It is gone within the second expires_at names.
        clock.now = 1_060
        assert http.get(f"/v1/videos/{completed}").status_code == 200
        assert http.get(f"/v1/videos/{completed}/content", params={"variant": "thumbnail"}).status_code == 200
        clock.now = 1_061
        assert_error(http.get(f"/v1/videos/{completed}"), 404, "video_not_found")


def test_failed_job_is_409_with_its_error(http, router):
    vid = create(http)["id"]
    router.step(vid)
    router.fail(vid)
    video = http.get(f"/v1/videos/{vid}").json()
    assert video["status"] == "failed"
    assert video["error"] == {"code": "generation_failed", "message": "video generation failed"}
    error = assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_failed", "video_id")
    assert "video generation failed" in error["message"]


def test_unknown_videos_are_404(http):
    for vid in (UNKNOWN, "nope", "video_../../etc"):
        assert_error(http.get(f"/v1/videos/{vid}"), 404, "video_not_found", "video_id")
        assert_error(http.get(f"/v1/videos/{vid}/content"), 404, "video_not_found")
        assert_error(http.delete(f"/v1/videos/{vid}"), 404, "video_not_found")
        assert_error(http.post(f"/v1/videos/{vid}/cancel"), 404, "video_not_found")


def test_form_bodies_as_openai_clients_send_them(http, router):
    form = {"prompt": "a fox", "model": "tiny-wan", "seconds": "2", "fps": "8", "seed": "3", "size": "32x32"}
    response = http.post("/v1/videos", files={k: (None, v) for k, v in form.items()})  # multipart/form-data
    assert response.status_code == 200, response.text
    assert (response.json()["num_frames"], response.json()["size"], response.json()["seed"]) == (17, "32x32", 3)
    assert http.post("/v1/videos", data={"prompt": "a fox", "num_frames": "5"}).json()["num_frames"] == 5
    upload = http.post("/v1/videos", data={"prompt": "a fox"}, files={"input_reference": ("a.png", b"x", "image/png")})
    assert_error(upload, 400, "unsupported_value", "input_reference")
    twice = http.post("/v1/videos", content=b"prompt=a&prompt=b",
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(twice, 400, "invalid_value", "prompt")
    assert len(router.submitted) == 2


def test_openai_client(app, http, router):
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the client flags its Sora methods
        video = client.videos.create(model="tiny-wan", prompt="a fox", size="64x64", seconds="1",
                                     extra_body={"num_inference_steps": 2})
        assert (video.status, video.size, video.progress) == ("queued", "64x64", 0)
        router.step(video.id, 1)
        assert (client.videos.retrieve(video.id).status, client.videos.retrieve(video.id).progress) == (
            "in_progress", 50)
        # The README's long poll: the header passes through the client; not ended within it, as it stands.
        assert client.videos.retrieve(video.id, extra_headers={"Prefer": "wait=0.05"}).status == "in_progress"
        router.finish(video.id)
        assert client.videos.retrieve(video.id, extra_headers={"Prefer": "wait=30"}).status == "completed"
        data = client.videos.download_content(video.id).read()
        finished = client.videos.retrieve(video.id)
        assert finished.expires_at == finished.completed_at + int(app.config.jobs.ttl_s)
        thumb = client.videos.download_content(video.id, variant="thumbnail")
        assert thumb.response.headers["content-type"] == "image/webp"
        assert Image.open(io.BytesIO(thumb.read())).size == (64, 64)
        sheet = client.videos.download_content(video.id, variant="spritesheet").read()
        assert Image.open(io.BytesIO(sheet)).size == (3 * 64, 3 * 64)  # 9 frames: 3x3
        listed = client.videos.list(limit=5)
        assert [v.id for v in listed.data] == [video.id]
        deleted = client.videos.delete(video.id)
        assert (deleted.id, deleted.deleted) == (video.id, True)
    assert len(decode_mp4(data)) == 9


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
    assert not router.submitted  # nothing reached the router
    assert http.get("/v1/videos").json()["data"] == []  # nor the job store


def test_malformed_and_oversized_bodies(http, router):
    headers = {"content-type": "application/json"}
    assert_error(http.post("/v1/videos", content=b"{not json", headers=headers), 400, "invalid_json")
    assert_error(http.post("/v1/videos", content=b"[1]", headers=headers), 400, "invalid_json")
    assert_error(http.post("/v1/videos", json={"prompt": "x" * 5000}), 413, "request_too_large")
    assert_error(http.post("/v1/videos", data={"prompt": "x" * 5000}), 413, "request_too_large")
    assert not router.submitted


@pytest.mark.parametrize("refusal,status,code,kind,retry_after", [
    (QueueFullError("the t2v queue is full", 429, 2.2), 429, "overloaded", "rate_limit_error", "3"),
    (QueueFullError("full", 429, None), 429, "overloaded", "rate_limit_error", "1"),
    (QueueFullError("no worker", 503, 5.0), 503, "unavailable", "server_error", "5"),
    (DuplicateRequestError("dup"), 409, "duplicate_request_id", "invalid_request_error", None),
])
def test_router_refusals_map_to_api_errors(http, router, refusal, status, code, kind, retry_after):
    router.refuse = refusal
    response = http.post("/v1/videos", json={"prompt": "a fox"})
    assert assert_error(response, status, code)["type"] == kind
    assert response.headers.get("retry-after") == retry_after
    assert response.headers["x-request-id"].startswith("video_")
    # A refused job leaves no trace: it is neither listed nor found.
    assert http.get("/v1/videos").json()["data"] == []
    assert_error(http.get(f"/v1/videos/{response.headers['x-request-id']}"), 404, "video_not_found")


def test_the_edge_sheds_a_full_video_queue_before_the_router(app, http, router):
    create(http)  # the first request starts the gate's watch on the router's load
    full = ClassLoad(queued=2, running=1, decoding=0, max_queued=2, drain_per_s=0.5)
    report = router.publish(classes={RequestKind.T2V: full})
    wait_until(lambda: app.ingress.videos.gate.report.version == report.version)
    response = http.post("/v1/videos", json=FOX)
    assert_error(response, 429, "overloaded")
    assert response.headers["retry-after"] == "2"  # one video ahead over the bound at 0.5 per second
    assert len(router.submitted) == 1
    # Images have their own class: a full video queue does not turn them away.
    assert http.post("/v1/images/generations", json={"prompt": "a cat"}).status_code == 200
    router.publish(live_workers=0)
    wait_until(lambda: app.ingress.videos.gate.report.live_workers == 0)
    response = http.post("/v1/videos", json=FOX)
    assert_error(response, 503, "unavailable")
    assert response.headers["retry-after"] == "5"


def test_job_table_full_is_429(monkeypatch):
    small = build(jobs={"max_jobs": 2})
    with http_client(small.ingress, monkeypatch) as http:
        create(http)
        create(http)
        response = http.post("/v1/videos", json=FOX)
        assert_error(response, 429, "overloaded")
        assert response.headers["retry-after"] == "5"
        assert len(small.router.submitted) == 2


def test_list_pages_newest_first_by_default(http):
    ids = [create(http)["id"] for _ in range(5)]
    everything = http.get("/v1/videos").json()
    assert everything["object"] == "list" and [v["id"] for v in everything["data"]] == ids[::-1]
    assert (everything["first_id"], everything["last_id"], everything["has_more"]) == (ids[4], ids[0], False)
    assert all(v["object"] == "video" and v["status"] == "queued" for v in everything["data"])

    page = http.get("/v1/videos", params={"limit": 2}).json()
    assert [v["id"] for v in page["data"]] == [ids[4], ids[3]] and page["has_more"]
    page = http.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
    assert [v["id"] for v in page["data"]] == [ids[2], ids[1]] and page["has_more"]
    page = http.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
    assert [v["id"] for v in page["data"]] == [ids[0]] and not page["has_more"]
    assert (page["first_id"], page["last_id"]) == (ids[0], ids[0])

    asc = http.get("/v1/videos", params={"order": "asc", "limit": 3}).json()
    assert [v["id"] for v in asc["data"]] == ids[:3] and asc["has_more"]
    rest = http.get("/v1/videos", params={"order": "asc", "after": asc["last_id"]}).json()
    assert [v["id"] for v in rest["data"]] == ids[3:] and not rest["has_more"]
    empty = http.get("/v1/videos", params={"after": ids[0]}).json()
    assert (empty["data"], empty["first_id"], empty["last_id"], empty["has_more"]) == ([], None, None, False)


def test_list_shows_live_progress(http, router):
    vid = create(http)["id"]
    router.step(vid, 1)
    (video,) = http.get("/v1/videos").json()["data"]
    assert (video["status"], video["steps_done"]) == ("in_progress", 1)


@pytest.mark.parametrize("params,param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": -1}, "limit"),
    ({"order": "newest"}, "order"), ({"order": "ASC"}, "order"),
    ({"after": UNKNOWN}, "after"), ({"after": "nope"}, "after"),
    ({"limit": "abc"}, "limit"),  # a wrong type, which FastAPI itself refuses: still the OpenAI shape
])
def test_bad_list_parameters_are_400(http, params, param):
    create(http)
    assert_error(http.get("/v1/videos", params=params), 400, "invalid_value", param)


def test_delete_cancels_a_live_job_and_forgets_it(http, router):
    vid = create(http)["id"]
    router.step(vid, 1)
    response = http.delete(f"/v1/videos/{vid}")
    assert response.status_code == 200
    assert response.json() == {"id": vid, "object": "video.deleted", "deleted": True}
    assert router.cancelled == [vid] and vid not in router.live
    assert_error(http.get(f"/v1/videos/{vid}"), 404, "video_not_found")
    assert_error(http.delete(f"/v1/videos/{vid}"), 404, "video_not_found")
    assert http.get("/v1/videos").json()["data"] == []


def test_delete_of_a_finished_job_removes_its_content(http, router):
    vid = create(http)["id"]
    router.finish(vid)
    assert http.get(f"/v1/videos/{vid}/content").status_code == 200  # now in the ingress's file cache
    assert http.delete(f"/v1/videos/{vid}").json()["deleted"] is True
    assert router.cancelled == []  # nothing to stop
    assert_error(http.get(f"/v1/videos/{vid}/content"), 404, "video_not_found")


def test_cancel_a_queued_or_running_job(http, router):
    queued, running = create(http)["id"], create(http)["id"]
    router.step(running, 2)
    for vid in (queued, running):
        response = http.post(f"/v1/videos/{vid}/cancel")
        assert response.status_code == 200, response.text
        video = response.json()
        assert (video["id"], video["status"], video["object"]) == (vid, "cancelled", "video")
        assert isinstance(video["completed_at"], int)
        assert http.get(f"/v1/videos/{vid}").json()["status"] == "cancelled"
        error = assert_error(http.get(f"/v1/videos/{vid}/content"), 409, "video_failed")
        assert "cancelled" in error["message"]
    assert router.cancelled == [queued, running]
    # An ended job cannot be cancelled again.
    assert_error(http.post(f"/v1/videos/{queued}/cancel"), 409, "video_not_cancellable", "video_id")


def test_cancel_a_job_the_router_already_let_go_of(http, router):
    vid = create(http)["id"]
    router.live.pop(vid)  # e.g. its worker failed it a moment ago and the store has not heard yet
    assert http.post(f"/v1/videos/{vid}/cancel").json()["status"] == "cancelled"
    assert router.cancelled == []


@pytest.mark.parametrize("end", ["finish", "fail"])
def test_cancel_a_finished_job_is_409(http, router, end):
    vid = create(http)["id"]
    getattr(router, end)(vid)
    error = assert_error(http.post(f"/v1/videos/{vid}/cancel"), 409, "video_not_cancellable", "video_id")
    assert ("completed" if end == "finish" else "failed") in error["message"]
    assert router.cancelled == []
    assert http.get(f"/v1/videos/{vid}").json()["status"] == ("completed" if end == "finish" else "failed")


def test_idempotency_key_returns_the_same_job(http, router):
    key = {"Idempotency-Key": "create-fox-1"}
    first = create(http, {"prompt": "a fox"}, headers=key)
    again = create(http, {"prompt": "a fox"}, headers=key)
    assert again["id"] == first["id"] and again["seed"] == first["seed"]
    assert router.submitted == [first["id"]]  # the retry never reached the router
    other = http.post("/v1/videos", json={"prompt": "a hare"}, headers=key)
    error = assert_error(other, 409, "idempotency_key_reused", "Idempotency-Key")
    assert "different request body" in error["message"]
    # Another key is another job; so is no key at all.
    assert create(http, {"prompt": "a fox"}, headers={"Idempotency-Key": "create-fox-2"})["id"] != first["id"]
    assert create(http, {"prompt": "a fox"})["id"] != first["id"]
    assert len(router.submitted) == 3
    # A finished job still answers its key.
    router.finish(first["id"])
    again = create(http, {"prompt": "a fox"}, headers=key)
    assert (again["id"], again["status"]) == (first["id"], "completed") and len(router.submitted) == 3


def test_a_refused_create_frees_its_idempotency_key(http, router):
    key = {"Idempotency-Key": "retry-me"}
    router.refuse = QueueFullError("full", 429, 1.0)
    assert_error(http.post("/v1/videos", json={"prompt": "a fox"}, headers=key), 429, "overloaded")
    router.refuse = None
    video = create(http, {"prompt": "a fox"}, headers=key)
    assert router.submitted == [video["id"]]
    # The body has no seed, yet the retry drew the refused attempt's: the key decides it.
    (refused, _), (accepted, _) = router.submit_video.calls
    assert refused.seed == accepted.seed == video["seed"]
    other = create(http, {"prompt": "a fox"}, headers={"Idempotency-Key": "another"})
    assert other["seed"] != video["seed"]


def test_bad_idempotency_keys_are_400(http, router):
    for key in (" ", "k" * 257):
        assert_error(http.post("/v1/videos", json=FOX, headers={"Idempotency-Key": key}), 400, "invalid_value",
                     "Idempotency-Key")
    assert not router.submitted


def test_failed_and_cancelled_jobs_are_kept_then_expire(monkeypatch):
    clock = ManualClock(1_000.0)
    app = build(clock, jobs={"ttl_s": 60})
    with http_client(app.ingress, monkeypatch) as http:
        failed, cancelled, live = create(http)["id"], create(http)["id"], create(http)["id"]
        app.router.fail(failed)
        clock.now += 10
        assert http.post(f"/v1/videos/{cancelled}/cancel").json()["status"] == "cancelled"
        clock.now += 49  # 59 s after the failure
        assert http.get(f"/v1/videos/{failed}").json()["status"] == "failed"
        assert [v["id"] for v in http.get("/v1/videos").json()["data"]] == [live, cancelled, failed]
        clock.now += 1  # the failed job's TTL is up
        assert_error(http.get(f"/v1/videos/{failed}"), 404, "video_not_found")
        assert http.get(f"/v1/videos/{cancelled}").json()["status"] == "cancelled"
        clock.now += 10
        assert_error(http.get(f"/v1/videos/{cancelled}"), 404, "video_not_found")
        clock.now += 10_000  # a live job never expires
        assert http.get(f"/v1/videos/{live}").json()["status"] == "queued"
        assert [v["id"] for v in http.get("/v1/videos").json()["data"]] == [live]


def test_completed_jobs_are_evicted_by_the_byte_budget_oldest_first(monkeypatch):
    one = 5 * 32 * 32 * 3  # bytes of FOX's frames
    app = build(jobs={"max_bytes": 2 * one + 100})
    with http_client(app.ingress, monkeypatch) as http:
        ids = [create(http)["id"] for _ in range(4)]
        for vid in ids[:3]:
            assert app.router.finish(vid)
        assert_error(http.get(f"/v1/videos/{ids[0]}"), 404, "video_not_found")
        assert_error(http.get(f"/v1/videos/{ids[0]}/content"), 404, "video_not_found")
        for vid in ids[1:3]:
            assert len(decode_mp4(http.get(f"/v1/videos/{vid}/content").content)) == 5
        assert http.get(f"/v1/videos/{ids[3]}").json()["status"] == "queued"  # live jobs are never evicted
        assert settle(app.store.stats())["bytes_stored"] == 2 * one


def test_jobs_a_router_restart_interrupted_run_again_and_fail_only_after_max_resumes(http, router):
    done, running, queued = create(http)["id"], create(http)["id"], create(http)["id"]
    router.finish(done)
    router.step(running, 2)
    assert sorted(router.restart()) == sorted([running, queued])
    for vid in (running, queued):  # taken up again from the start by the new router
        assert http.get(f"/v1/videos/{vid}").json()["status"] == "queued"
        assert router.live[vid]["steps_done"] == 0
    router.finish(queued)
    assert len(decode_mp4(http.get(f"/v1/videos/{queued}/content").content)) == 5
    for _ in range(MAX_RESUMES - 1):
        assert router.restart() == [running]
    assert router.restart() == []  # restarted MAX_RESUMES times: it may be what takes the router down
    video = http.get(f"/v1/videos/{running}").json()
    assert (video["status"], video["error"]["code"]) == ("failed", "interrupted")
    assert "create it again" in video["error"]["message"]
    assert_error(http.get(f"/v1/videos/{running}/content"), 409, "video_failed")
    assert_error(http.post(f"/v1/videos/{running}/cancel"), 409, "video_not_cancellable")
    # What finished before the restarts is safe in the store.
    assert http.get(f"/v1/videos/{done}").json()["status"] == "completed"
    assert len(decode_mp4(http.get(f"/v1/videos/{done}/content").content)) == 5


def test_a_router_that_cannot_answer_progress_leaves_the_stored_status(http, router):
    vid = create(http)["id"]

    def restarting(rid):
        raise ray.exceptions.RayActorError()

    router.progress.fn = restarting
    video = http.get(f"/v1/videos/{vid}").json()
    assert (video["status"], video["steps_done"]) == ("queued", 0)


def test_video_model_on_the_image_route_is_400(http):
    response = http.post("/v1/images/generations", json={"prompt": "a cat", "model": "tiny-wan"})
    assert_error(response, 400, "unsupported_model", "model")


def test_models_lists_image_and_video_models(http):
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["kind"]) for m in models] == [("tiny-sd", "t2i"), ("tiny-wan", "t2v")]


def test_handle_methods_share_the_http_code(app):
    ingress, router = app.ingress, app.router

    async def scenario():
        video = await ingress.create_video(FOX)
        typed = await ingress.create_video(VideoCreateRequest(prompt="a hare", seconds=1, fps=8))
        assert (video["status"], video["num_frames"], typed["num_frames"]) == ("queued", 5, 9)
        again = await ingress.create_video(FOX, idempotency_key="k")
        assert (await ingress.create_video(FOX, idempotency_key="k"))["id"] == again["id"]
        with pytest.raises(APIError) as info:
            await ingress.video_content(video["id"])
        assert (info.value.status, info.value.code) == (409, "video_not_ready")
        router.finish(video["id"])
        assert (await ingress.get_video(video["id"]))["status"] == "completed"
        frames = decode_mp4(await ingress.video_content(video["id"]))
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
        assert len(await ingress.video_content(video["id"], "frames")) > 0
        listed = await ingress.list_videos(limit=2)
        assert [v["id"] for v in listed["data"]] == [again["id"], typed["id"]] and listed["has_more"]
        assert (await ingress.cancel_video(typed["id"]))["status"] == "cancelled"
        assert (await ingress.delete_video(again["id"]))["deleted"] is True
        for call, status in ((ingress.get_video("video_" + "f" * 32), 404),
                             (ingress.create_video({"prompt": "a fox", "size": "33x33"}), 400),
                             (ingress.list_videos(limit=0), 400)):
            with pytest.raises(APIError) as info:
                await call
            assert info.value.status == status
        router.refuse = QueueFullError("full", 429, 1.0)
        with pytest.raises(APIError) as info:
            await ingress.create_video({"prompt": "a fox"})
        assert (info.value.status, info.value.retry_after_s) == (429, 1.0)

    asyncio.run(scenario())


def test_prefer_wait_blocks_until_the_job_ends(app, http, router):
    vid = create(http)["id"]
    # Not ended within the wait: the job as it stands, and the header says the wait was applied.
    response = http.get(f"/v1/videos/{vid}", headers={"Prefer": "wait=0.05"})
    assert response.status_code == 200 and response.json()["status"] == "queued"
    assert response.headers["preference-applied"] == "wait=0.05"
    router.finish(vid)
    response = http.get(f"/v1/videos/{vid}", headers={"Prefer": "respond-async, wait=30"})
    assert response.json()["status"] == "completed"  # ended: at once
    assert_error(http.get("/v1/videos/" + UNKNOWN, headers={"Prefer": "wait=1"}), 404, "video_not_found", "video_id")

    async def scenario():
        video = await app.ingress.create_video(FOX)

        async def finish_soon():
            await asyncio.sleep(0.02)
            router.finish(video["id"])

        waited, _ = await asyncio.wait_for(asyncio.gather(app.ingress.get_video(video["id"], 30), finish_soon()), 5)
        assert waited["status"] == "completed"

    asyncio.run(scenario())


@pytest.mark.parametrize("header, seconds", [
    (None, 0.0), ("", 0.0), ("wait=5", 5.0), ("Wait = 2.5", 2.5), ('wait="3"', 3.0), ("return=minimal, wait=1", 1.0),
    ("wait=999", 60.0), ("wait=inf", 60.0), ("wait=-1", 0.0), ("wait=nan", 0.0), ("wait=soon", 0.0), ("handling=lenient", 0.0),
])
def test_prefer_wait_header_is_parsed_leniently(header, seconds):
    assert preferred_wait_s(header) == seconds


def test_jobs_created_by_another_replica_are_served_in_full():
    # Ingress replicas share the job store and the router: any replica serves any job.
    app = build()
    other = type(app.ingress)(app.config, app.router, app.ingress.videos.store, app.text_encoder)

    async def scenario():
        vid = (await app.ingress.create_video(FOX))["id"]
        app.router.step(vid, 1)
        seen = await other.get_video(vid)
        assert (seen["status"], seen["model"], seen["size"], seen["steps_done"]) == ("in_progress", "tiny-wan",
                                                                                     "32x32", 1)
        app.router.finish(vid)
        assert (await other.video_content(vid))[4:8] == b"ftyp"
        assert (await other.delete_video(vid))["deleted"] is True
        with pytest.raises(APIError) as info:
            await app.ingress.get_video(vid)
        assert info.value.status == 404

    asyncio.run(scenario())
