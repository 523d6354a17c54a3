"""The job store writes each call's changes through to durable storage and reads them back when it
starts again: a restarted store has every job, finished video, running video's checkpoint and
remembered image response it had, in the same order, under the same budgets."""

import asyncio
import pickle

import numpy as np
import pytest

from stepserve.deployments.job_journal import DiskJournal, JournalSpec
from stepserve.deployments.job_store import JobStore
from stepserve.deployments.jobs import Checkpoint, JobTable

from tests.cpu.deployments.test_jobs import FakeClock, frames, ids, job

run = asyncio.run


def disk(tmp_path) -> JournalSpec:
    return JournalSpec("disk", disk_dir=str(tmp_path / "jobs"))


def state(table: JobTable, now: float):
    """Everything a client or the router can see of a table."""
    records, _ = table.page(None, 100, "asc", now)
    return ([(r, table.result(r.job_id, now) is not None) for r in records], table.bytes_stored, table.counts,
            list(table._retired), {k: (i.digest, i.body) for k, i in table._images.items()})


def test_a_restarted_store_has_what_it_had(tmp_path):
    clock = FakeClock()
    store = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=disk(tmp_path), clock=clock)
    for vid in ("v1", "v2", "v3"):
        run(store.create(job(vid, key=f"k-{vid}", digest="d")))
    run(store.set_status("v1", "in_progress"))
    assert run(store.complete("v1", frames()))
    run(store.set_status("v2", "in_progress"))
    assert run(store.checkpoint("v2", 5, {"latents": np.ones(3)}, (1, 2, 2, 2, 1)))
    assert not run(store.checkpoint("v2", 4, {"latents": np.zeros(3)}, (1,) * 4))  # older: kept the newer
    run(store.set_status("v3", "cancelled"))
    assert run(store.remember_image("img-key", "d", b"png-bytes"))
    clock.now += 1
    run(store.create(job("v4")))
    run(store.create(job("v5")))  # 5 jobs > max_jobs 4: the oldest ended one (v1) goes
    assert run(store.get("v1")) is None

    again = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=disk(tmp_path), clock=clock)
    assert state(again.table, clock.now) == state(store.table, clock.now)
    assert ids(run(again.page())[0]) == ["v5", "v4", "v3", "v2"]
    assert run(again.image_for("img-key", "d")) == b"png-bytes"
    assert run(again.create(job("v9", key="k-v2", digest="d"))).job_id == "v2"  # idempotency keys too
    (resumed, checkpoint), *others = run(again.resume_unfinished(2, "restarted"))
    assert resumed.job_id == "v2" and resumed.resumed_from_step == 5 and resumed.resumes == 1
    assert checkpoint.steps == 5 and checkpoint.degrees == (1, 2, 2, 2, 1)
    assert np.array_equal(checkpoint.state["latents"], np.ones(3))
    assert [(r.job_id, c) for r, c in others] == [("v4", None), ("v5", None)]
    # Completing it drops its checkpoint, and a third store sees that.
    assert run(again.complete("v2", frames()))
    third = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=disk(tmp_path), clock=clock)
    assert third.table._entries["v2"].checkpoint is None
    assert np.array_equal(run(third.content("v2")), frames())
    # Expiry is written through as well.
    clock.now += 120
    assert run(third.get("v2")) is None
    fourth = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=disk(tmp_path), clock=clock)
    assert ids(run(fourth.page())[0]) == ["v5", "v4"] and fourth.table.bytes_stored == 0


def test_a_job_store_without_storage_keeps_nothing_on_disk(tmp_path):
    store = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, clock=FakeClock())
    run(store.create(job("v1")))
    assert store.journal is None and not list(tmp_path.iterdir())


def test_a_complete_made_again_after_a_restart_is_done_not_refused(tmp_path):
    clock = FakeClock()
    store = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=disk(tmp_path), clock=clock)
    run(store.create(job("v1")))
    assert run(store.complete("v1", frames()))
    again = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=disk(tmp_path), clock=clock)
    assert run(again.complete("v1", frames()))


def test_disk_writes_are_whole_files_and_a_damaged_one_is_skipped(tmp_path):
    journal = DiskJournal(tmp_path)
    table = JobTable(60, 1000, 10)
    table.create(job("a"), 0)
    table.create(job("b"), 0)
    journal.write(table.take_changes())
    assert not table.take_changes()  # nothing new
    files = sorted((tmp_path / "jobs").iterdir())
    assert len(files) == 2 and not list((tmp_path / "jobs").glob(".tmp-*"))
    files[0].write_bytes(b"not a pickle")
    (tmp_path / "jobs" / ".tmp-cut-short").write_bytes(b"half")
    jobs, images = journal.load()
    assert len(jobs) == 1 and images == []
    assert not list((tmp_path / "jobs").glob(".tmp-*"))
    pickle.loads(files[1].read_bytes())


def test_restore_needs_an_empty_table():
    table = JobTable(60, 1000, 10)
    table.create(job("a"), 0)
    with pytest.raises(ValueError, match="empty table"):
        table.restore([], [])


def test_a_checkpoint_of_an_ended_or_unknown_job_is_refused():
    table = JobTable(60, 1000, 10)
    table.create(job("a"), 0)
    table.update_status("a", "cancelled", 0)
    assert not table.checkpoint("a", Checkpoint(3, {}, (1, 1, 1)))
    assert not table.checkpoint("zz", Checkpoint(3, {}, (1, 1, 1)))


def test_redis_storage_needs_a_url():
    from stepserve.deployments.config import JobsConfig

    with pytest.raises(ValueError, match="redis_url"):
        JobsConfig(storage="redis")
    assert JobsConfig(storage="memory").journal_spec() is None
    first, second = JobsConfig().journal_spec(), JobsConfig().journal_spec()
    assert first.kind == "disk" and first.disk_dir != second.disk_dir  # a new folder each build


@pytest.fixture
def redis_url():
    """A Redis server on a local port for redis-py to talk to over TCP: fakeredis's (the test
    double of the server; the client, the wire protocol and `from_url` are the real ones)."""
    import socket
    import threading

    from fakeredis import TcpFakeServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{port}/0"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_redis_storage_reads_back_what_it_wrote(redis_url):
    spec = JournalSpec("redis", redis_url=redis_url, redis_prefix="app-a")
    clock = FakeClock()
    store = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=spec, clock=clock)
    run(store.create(job("v1")))
    run(store.create(job("v2")))
    assert run(store.complete("v1", frames()))
    run(store.checkpoint("v2", 3, {"latents": np.arange(4)}, (1, 1, 1)))
    assert run(store.remember_image("ik", "d", b"png"))
    run(store.delete("v1"))
    again = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=spec, clock=clock)
    assert state(again.table, clock.now) == state(store.table, clock.now)
    assert again.table._entries["v2"].checkpoint.steps == 3
    other = JobStore(ttl_s=60, max_bytes=300, max_jobs=4, journal=JournalSpec("redis", redis_url=redis_url,
                                                                              redis_prefix="app-b"), clock=clock)
    assert len(other.table) == 0  # another prefix, another app's jobs


def test_a_redis_password_env_must_be_set_where_the_store_runs(monkeypatch):
    monkeypatch.delenv("NO_SUCH_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_PASSWORD"):
        JournalSpec("redis", redis_url="redis://127.0.0.1:1/0", redis_password_env="NO_SUCH_PASSWORD").open()
