"""The activation store: its disk reads run outside its lock (a get goes on while a prefetch
reads) and once per key; and as a per-node Ray actor, puts, gets, prefetches and counts."""

import threading
import time

import pytest
import ray
import torch

from stepserve.actors import activation_store
from stepserve.actors.activation_cache import ActivationCache
from stepserve.actors.activation_store import (
    ActivationStore, ActivationStoreSpec, StoreActivations, node_store, start_activation_stores,
)
from stepserve.runtime import start_local_ray

VALUE_BYTES = 2 * 4 * 16 * 4  # what `value` holds


def value(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"0.0": torch.randn(4, 16, generator=g), "0.1": torch.randn(4, 16, generator=g)}


def assert_equal(got, expected):
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_prefetch_reads_beside_gets_and_a_get_of_its_key_waits_for_it(tmp_path, monkeypatch):
    store = ActivationStore(VALUE_BYTES, str(tmp_path))
    store.put("a", value(1))
    store.put("b", value(2))  # "a" goes to disk
    started, release, reads = threading.Event(), threading.Event(), []
    read = activation_store.read_spilled

    def held_read(load):
        reads.append(load.key)
        started.set()
        release.wait(10)
        return read(load)

    monkeypatch.setattr(activation_store, "read_spilled", held_read)
    assert store.prefetch(["a", "b", "nope"]) == {"a": "disk", "b": "memory", "nope": None}
    assert started.wait(10)
    assert_equal(store.get("b"), value(2))  # while "a" is being read
    got = {}
    waiting = threading.Thread(target=lambda: got.update(a=store.get("a")))
    waiting.start()
    release.set()
    waiting.join(10)
    assert_equal(got["a"], value(1))
    assert reads == ["a"]  # the get took what the prefetch read
    stats = store.stats()
    assert (stats.memory_hits, stats.disk_hits, stats.misses, stats.bytes_loaded) == (2, 0, 0, VALUE_BYTES)


def put_in_order(store, keys, first_seed: int) -> None:
    """One put at a time: the actor is threaded, calls in flight together run in no set order."""
    for i, key in enumerate(keys):
        ray.get(store.put.remote(key, value(first_seed + i)))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    started_here = not ray.is_initialized()
    start_local_ray(num_cpus=2)
    disk_dir = tmp_path_factory.mktemp("activations")
    stores = start_activation_stores(ActivationStoreSpec(2 * VALUE_BYTES, str(disk_dir)), "test")
    assert set(stores) == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    yield node_store(stores)
    for handle in stores.values():
        ray.kill(handle)
    if started_here:
        ray.shutdown()


def test_the_actor_puts_spills_and_reads_back(store):
    put_in_order(store, "abc", 0)
    assert ray.get([store.contains.remote(key) for key in "abc"]) == ["disk", "memory", "memory"]
    assert_equal(ray.get(store.get.remote("a")), value(0))
    assert ray.get(store.get.remote("nope")) is None
    with pytest.raises(ray.exceptions.RayTaskError, match="memory budget"):
        ray.get(store.put.remote("big", {"x": torch.zeros(VALUE_BYTES)}))
    stats = ray.get(store.stats.remote())
    assert (stats.disk_hits, stats.misses, stats.bytes_spilled) == (1, 1, 2 * VALUE_BYTES)


def test_the_actor_prefetches_in_the_background(store):
    put_in_order(store, "xyz", 10)
    assert ray.get(store.prefetch.remote(["x", "z", "nope"])) == {"x": "disk", "z": "memory", "nope": None}
    wait_for(lambda: ray.get(store.contains.remote("x")) == "memory")
    before = ray.get(store.stats.remote())
    assert_equal(ray.get(store.get.remote("x")), value(10))
    after = ray.get(store.stats.remote())
    assert (after.memory_hits - before.memory_hits, after.disk_hits - before.disk_hits) == (1, 0)


def test_a_worker_keeps_the_records_it_used_last(store):
    """`StoreActivations` (a worker's view of its node's store): what it put or got once comes from
    its own LRU afterwards; without one (worker_bytes 0) every get asks the store."""
    keeping = StoreActivations(store, ActivationCache(2 * VALUE_BYTES))
    asking = StoreActivations(store)
    keeping.put("w", value(30))
    wait_for(lambda: ray.get(store.contains.remote("w")) is not None)
    before = ray.get(store.stats.remote())
    assert_equal(keeping.get("w"), value(30))
    assert_equal(asking.get("w"), value(30))
    after = ray.get(store.stats.remote())
    assert after.memory_hits + after.disk_hits - before.memory_hits - before.disk_hits == 1  # the asking one's
    assert keeping.get("missing") is None and ray.get(store.stats.remote()).misses == after.misses + 1
