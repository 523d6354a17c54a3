"""The job table (TTL, byte budget, record cap, idempotency, pagination) and JobStore's methods."""

import asyncio
import pickle

import numpy as np
import pytest

from stepserve.deployments.job_store import JobStore
from stepserve.deployments.jobs import (
    DuplicateJobId,
    IdempotencyConflict,
    JobRecord,
    JobTable,
    JobTableFull,
    ResultTooLarge,
)


def job(job_id: str, key: str | None = None, digest: str | None = None) -> JobRecord:
    return JobRecord(job_id=job_id, kind="video", created_at=0.0, spec={"prompt": job_id},
                     idempotency_key=key, request_digest=digest)


def table(ttl_s: float = 100.0, max_bytes: int = 1000, max_jobs: int = 100, jobs: int = 0) -> JobTable:
    t = JobTable(ttl_s, max_bytes, max_jobs)
    for i in range(jobs):
        t.create(job(f"j{i}"), now=0)
    return t


def ids(records) -> list[str]:
    return [r.job_id for r in records]


def test_lifecycle_sets_completed_at_and_keeps_the_result():
    t = table(jobs=1)
    assert t.update_status("j0", "in_progress", now=1)
    assert t.get("j0", now=1).status == "in_progress"
    assert t.result("j0", now=1) is None
    assert t.complete("j0", "frames", nbytes=10, now=2)
    record = t.get("j0", now=3)
    assert (record.status, record.completed_at, record.result_bytes) == ("completed", 2, 10)
    assert t.result("j0", now=3) == "frames"
    assert t.bytes_stored == 10
    assert t.counts == {"queued": 0, "in_progress": 0, "completed": 1, "failed": 0, "cancelled": 0}


def test_an_ended_job_is_final_and_unknown_ids_are_ignored():
    t = table(jobs=2)
    assert t.update_status("j0", "cancelled", now=1)
    assert not t.update_status("j0", "in_progress", now=2)
    assert not t.complete("j0", "late frames", nbytes=10, now=2)  # cancelled while decoding
    assert t.get("j0", now=2).status == "cancelled" and t.result("j0", now=2) is None
    assert not t.update_status("nope", "failed", now=2)
    assert not t.complete("nope", "x", nbytes=1, now=2)
    with pytest.raises(ValueError, match="complete"):
        t.update_status("j1", "completed", now=2)
    with pytest.raises(ValueError, match="unknown job status"):
        t.update_status("j1", "done", now=2)


def test_failed_job_keeps_its_error():
    t = table(jobs=1)
    error = {"code": "generation_failed", "message": "worker died"}
    assert t.update_status("j0", "failed", now=5, error=error)
    record = t.get("j0", now=5)
    assert (record.status, record.completed_at, record.error) == ("failed", 5, error)
    with pytest.raises(ValueError, match="code"):
        table(jobs=1).update_status("j0", "failed", now=5, error={"message": "no code"})


def test_ttl_evicts_completed_and_failed_jobs_but_never_running_ones():
    t = table(ttl_s=10, jobs=4)
    t.complete("j0", "r0", nbytes=5, now=1)
    t.update_status("j1", "failed", now=2, error={"code": "x", "message": "y"})
    t.update_status("j2", "in_progress", now=2)  # j3 stays queued
    assert t.expire(now=10.9) == []
    assert t.expire(now=11) == ["j0"]
    assert t.bytes_stored == 0
    assert t.get("j1", now=11.5) is not None
    assert t.get("j1", now=12) is None  # expired lazily by the call itself
    assert ids(t.page(None, 10, "asc", now=1e9)[0]) == ["j2", "j3"]
    assert t.evictions == 2


def test_byte_budget_evicts_the_oldest_completed_first():
    t = table(max_bytes=100, jobs=4)
    # Completion order j2, j0, j1 (not creation order) is what eviction follows.
    t.complete("j2", "r2", nbytes=40, now=1)
    t.complete("j0", "r0", nbytes=40, now=2)
    t.complete("j1", "r1", nbytes=40, now=3)
    assert t.get("j2", now=3) is None
    assert ids(t.page(None, 10, "asc", now=3)[0]) == ["j0", "j1", "j3"]
    assert t.bytes_stored == 80
    t.complete("j3", "r3", nbytes=100, now=4)  # exactly the budget: everything older goes
    assert ids(t.page(None, 10, "asc", now=4)[0]) == ["j3"]
    assert t.bytes_stored == 100 and t.evictions == 3


def test_byte_budget_eviction_takes_older_zero_byte_records_with_it():
    # Eviction is a prefix of retirement order: what survives is one recent stretch of history.
    t = table(max_bytes=100, jobs=3)
    t.complete("j0", "r0", nbytes=60, now=1)
    t.update_status("j1", "failed", now=2)
    t.complete("j2", "r2", nbytes=60, now=3)
    assert ids(t.page(None, 10, "asc", now=3)[0]) == ["j1", "j2"]


def test_oversize_result_is_refused_and_nothing_is_evicted():
    t = table(max_bytes=100, jobs=2)
    t.complete("j0", "r0", nbytes=50, now=1)
    with pytest.raises(ResultTooLarge, match="101 bytes"):
        t.complete("j1", "huge", nbytes=101, now=2)
    assert t.get("j1", now=2).status == "queued"
    assert t.result("j0", now=2) == "r0" and t.bytes_stored == 50


def test_max_jobs_evicts_the_oldest_ended_records():
    t = table(max_jobs=3, jobs=3)
    t.update_status("j1", "cancelled", now=1)
    t.update_status("j0", "failed", now=2)
    t.create(job("j3"), now=3)
    assert t.get("j1", now=3) is None and t.get("j0", now=3) is not None
    t.create(job("j4"), now=4)
    assert ids(t.page(None, 10, "asc", now=4)[0]) == ["j2", "j3", "j4"]


def test_running_jobs_are_never_evicted_for_a_new_one():
    t = table(max_jobs=2, jobs=2)
    t.update_status("j1", "in_progress", now=1)
    with pytest.raises(JobTableFull):
        t.create(job("j2"), now=2)
    assert len(t) == 2
    t.update_status("j0", "failed", now=3)
    t.create(job("j2"), now=4)
    assert ids(t.page(None, 10, "asc", now=4)[0]) == ["j1", "j2"]


def test_idempotent_create_returns_the_same_job():
    t = table()
    first = t.create(job("a", key="k", digest="d1"), now=0)
    again = t.create(job("b", key="k", digest="d1"), now=1)
    assert again == first and len(t) == 1
    assert t.find_by_key("k", now=1).job_id == "a"
    with pytest.raises(IdempotencyConflict, match="'k'"):
        t.create(job("c", key="k", digest="d2"), now=1)
    assert len(t) == 1


def test_an_idempotency_key_is_free_again_once_its_job_is_gone():
    t = table(ttl_s=10)
    t.create(job("a", key="k", digest="d1"), now=0)
    t.update_status("a", "failed", now=1)
    assert t.create(job("b", key="k", digest="d2"), now=11).job_id == "b"
    t.delete("b")
    assert t.find_by_key("k", now=11) is None
    assert t.create(job("c", key="k", digest="d3"), now=11).job_id == "c"


def test_job_ids_must_be_new_and_jobs_start_live():
    t = table(jobs=1)
    with pytest.raises(DuplicateJobId):
        t.create(job("j0"), now=0)
    with pytest.raises(ValueError, match="queued or in progress"):
        t.create(JobRecord("x", "video", 0.0, None, status="failed"), now=0)
    with pytest.raises(ValueError, match="unknown job status"):
        JobRecord("x", "video", 0.0, None, status="done")


def test_pagination_both_ways_with_cursors():
    t = table(jobs=5)
    records, more = t.page(None, 2, "asc", now=0)
    assert (ids(records), more) == (["j0", "j1"], True)
    records, more = t.page("j1", 2, "asc", now=0)
    assert (ids(records), more) == (["j2", "j3"], True)
    records, more = t.page("j3", 2, "asc", now=0)
    assert (ids(records), more) == (["j4"], False)
    records, more = t.page(None, 3, "desc", now=0)
    assert (ids(records), more) == (["j4", "j3", "j2"], True)
    records, more = t.page("j2", 3, "desc", now=0)
    assert (ids(records), more) == (["j1", "j0"], False)
    assert t.page("j0", 3, "desc", now=0) == ([], False)
    records, more = t.page(None, 5, "asc", now=0)
    assert (ids(records), more) == (["j0", "j1", "j2", "j3", "j4"], False)
    assert table().page(None, 5, "desc", now=0) == ([], False)


def test_pagination_skips_deleted_jobs_and_refuses_unknown_cursors():
    t = table(jobs=4)
    assert t.delete("j1").job_id == "j1"
    assert t.delete("j1") is None
    t.delete("j3")  # the last one
    t.delete("j0")  # the first one
    assert ids(t.page(None, 10, "asc", now=0)[0]) == ["j2"]
    t.create(job("j5"), now=0)
    assert ids(t.page(None, 10, "desc", now=0)[0]) == ["j5", "j2"]
    with pytest.raises(ValueError, match="unknown cursor"):
        t.page("j1", 10, "asc", now=0)
    with pytest.raises(ValueError, match="limit"):
        t.page(None, 0, "asc", now=0)
    with pytest.raises(ValueError, match="order"):
        t.page(None, 1, "newest", now=0)


def test_delete_frees_the_result_bytes():
    t = table(jobs=1)
    t.complete("j0", "r0", nbytes=30, now=1)
    t.delete("j0")
    assert t.bytes_stored == 0 and len(t) == 0 and t.counts["completed"] == 0
    assert t.evictions == 0  # a delete is not an eviction


def test_image_idempotency():
    t = table(ttl_s=10)
    assert t.image_for("k", "d1", now=0) is None
    assert t.remember_image("k", "d1", b"png", nbytes=3, now=0)
    assert t.image_for("k", "d1", now=1) == b"png"
    assert not t.remember_image("k", "d1", b"png again", nbytes=9, now=1)  # first one kept
    assert t.image_for("k", "d1", now=1) == b"png"
    with pytest.raises(IdempotencyConflict):
        t.image_for("k", "d2", now=1)
    with pytest.raises(IdempotencyConflict):
        t.remember_image("k", "d2", b"other", nbytes=5, now=1)
    assert t.image_for("k", "d1", now=10) is None  # TTL from when it was remembered
    assert t.bytes_stored == 0 and t.images == 0


def test_images_and_video_results_share_the_byte_budget_oldest_first():
    t = table(max_bytes=100, jobs=2)
    t.remember_image("old", "d", b"x", nbytes=40, now=1)
    t.complete("j0", "r0", nbytes=40, now=2)
    t.remember_image("new", "d", b"y", nbytes=40, now=3)
    assert t.image_for("old", "d", now=3) is None
    assert t.result("j0", now=3) == "r0"
    t.complete("j1", "r1", nbytes=40, now=4)
    assert t.get("j0", now=4) is None and t.image_for("new", "d", now=4) == b"y"
    assert t.bytes_stored == 80
    with pytest.raises(ResultTooLarge):
        t.remember_image("big", "d", b"z", nbytes=101, now=5)


def test_errors_pickle():
    for error in (IdempotencyConflict("k"), DuplicateJobId("j"), JobTableFull("full"), ResultTooLarge("big")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        JobTable(ttl_s=1, max_bytes=1, max_jobs=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def frames(n: int = 2) -> np.ndarray:
    return np.arange(n * 4 * 4 * 3, dtype=np.uint8).reshape(n, 4, 4, 3)


def test_job_store_methods():
    clock = FakeClock()
    store = JobStore(ttl_s=60, max_bytes=200, max_jobs=10, clock=clock)
    run = asyncio.run

    run(store.create(job("v1", key="k", digest="d")))
    assert run(store.create(job("v2", key="k", digest="d"))).job_id == "v1"
    assert run(store.set_status("v1", "in_progress"))
    sent = frames()
    assert run(store.complete("v1", sent))
    sent[:] = 0  # the store owns a copy
    content = run(store.content("v1"))
    assert np.array_equal(content, frames()) and not content.flags.writeable
    got = run(store.get("v1"))
    assert (got.status, got.completed_at, got.result_bytes) == ("completed", 1000.0, 96)

    run(store.create(job("v2")))
    assert not run(store.complete("v2", frames(5)))  # 240 bytes > 200: refused, job failed
    failed = run(store.get("v2"))
    assert failed.status == "failed" and failed.error["code"] == "result_too_large"
    assert run(store.content("v2")) is None
    with pytest.raises(ValueError, match="uint8"):
        run(store.complete("v2", frames().astype(np.float32)))

    assert ids(run(store.page())[0]) == ["v2", "v1"]
    assert run(store.page(after="v2", limit=1, order="desc")) == ([got], False)

    assert run(store.remember_image("ik", "d", b"12345"))
    assert run(store.image_for("ik", "d")) == b"12345"
    assert run(store.remember_image("ik2", "d", {"data": [{"b64_json": "aGk="}]}))
    assert run(store.image_for("ik2", "d")) == {"data": [{"b64_json": "aGk="}]}

    stats = run(store.stats())
    assert stats["jobs"]["completed"] == 1 and stats["jobs"]["failed"] == 1
    assert stats["images"] == 2 and stats["bytes_stored"] > 96 + 5

    assert run(store.delete("v2")).job_id == "v2"
    clock.now += 60  # everything ended or remembered at 1000 expires
    assert run(store.get("v1")) is None and run(store.image_for("ik", "d")) is None
    stats = run(store.stats())
    assert stats["bytes_stored"] == 0 and stats["images"] == 0 and stats["evictions"] == 3


def test_job_store_wait_returns_when_the_job_ends():
    store = JobStore(ttl_s=60, max_bytes=1000, max_jobs=10, clock=FakeClock())

    async def scenario():
        for vid in ("done", "failed", "gone", "lost", "slow"):
            await store.create(job(vid))
        await store.complete("done", frames())
        # Ended or unknown: at once.
        assert (await store.wait("done", 30)).status == "completed"
        assert await store.wait("nope", 30) is None

        async def later(action):
            await asyncio.sleep(0.01)
            await action

        # Live: it returns when the job ends, however it ends, long before the timeout.
        for vid, action, expect in (
                ("failed", store.set_status("failed", "failed", {"code": "x", "message": "y"}), "failed"),
                ("gone", store.delete("gone"), None),
                ("lost", store.resume_unfinished(0, "router restarted"), "failed")):
            waited, _ = await asyncio.wait_for(asyncio.gather(store.wait(vid, 30), later(action)), 5)
            assert (waited and waited.status) == expect
        # A status change that does not end the job does not wake it; the timeout does.
        await store.create(job("slow2"))
        waited, _ = await asyncio.gather(store.wait("slow2", 0.05), later(store.set_status("slow2", "in_progress")))
        assert waited.status == "in_progress"
        assert store._ended == {"slow2": store._ended["slow2"]}  # kept until the job ends...
        await store.set_status("slow2", "cancelled")
        assert store._ended == {}  # ...then dropped

    asyncio.run(scenario())


def test_a_tenants_pages_hold_its_jobs_only():
    t = table()
    for i, owner in enumerate("abaab"):
        t.create(JobRecord(f"j{i}", "video", 0.0, {}, owner=owner), now=0)
    assert ids(t.page(None, 2, "asc", now=0, owner="a")[0]) == ["j0", "j2"]
    assert t.page(None, 2, "asc", now=0, owner="a")[1]  # j3 follows
    assert t.page("j2", 2, "asc", now=0, owner="a") == ([t.get("j3", now=0)], False)
    assert ids(t.page(None, 5, "desc", now=0, owner="b")[0]) == ["j4", "j1"]
    assert ids(t.page(None, 5, "asc", now=0)[0]) == ["j0", "j1", "j2", "j3", "j4"]  # no owner: every job
    with pytest.raises(ValueError, match="unknown cursor"):
        t.page("j1", 2, "asc", now=0, owner="a")  # another tenant's job is no cursor
