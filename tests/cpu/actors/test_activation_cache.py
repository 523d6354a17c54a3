"""The activation cache without Ray: least-recently-used order in memory, spills to disk read back
equal, the disk budget dropping the oldest, refusal of what cannot fit, prefetch, the counters,
and the two-halved load the store runs without its lock."""

import os

import pytest
import torch

from stepserve.actors.activation_cache import ActivationCache, PendingLoad, read_spilled

VALUE_BYTES = 2 * 16 * 4 + 16 * 2  # what `value` holds


def value(seed: int) -> dict[str, torch.Tensor]:
    """One template's activations in miniature: two float32 blocks and a bfloat16 one."""
    g = torch.Generator().manual_seed(seed)
    return {"0.0": torch.randn(4, 4, generator=g), "0.1": torch.randn(16, generator=g),
            "1.0": torch.randn(16, generator=g).to(torch.bfloat16)}


def assert_equal(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype
        assert torch.equal(got[name], expected[name])


def spill_files(disk_dir) -> list[str]:
    return sorted(os.listdir(disk_dir))


def test_memory_keeps_the_most_recently_used_within_its_budget():
    cache = ActivationCache(2 * VALUE_BYTES)
    cache.put("a", value(1))
    cache.put("b", value(2))
    assert_equal(cache.get("a"), value(1))  # "a" is now the most recent
    cache.put("c", value(3))
    assert [cache.contains(k) for k in "abc"] == ["memory", None, "memory"]
    assert cache.get("b") is None
    stats = cache.stats()
    assert (stats.memory_hits, stats.misses, stats.evictions, stats.drops) == (1, 1, 1, 1)
    assert (stats.memory_values, stats.memory_bytes, stats.disk_values, stats.disk_bytes) == (2, 2 * VALUE_BYTES, 0, 0)


def test_a_value_pushed_out_is_spilled_and_read_back_equal(tmp_path):
    cache = ActivationCache(2 * VALUE_BYTES, str(tmp_path))
    for i, key in enumerate("abc"):
        cache.put(key, value(i))
    assert [cache.contains(k) for k in "abc"] == ["disk", "memory", "memory"]
    assert len(spill_files(tmp_path)) == 1
    assert_equal(cache.get("a"), value(0))  # read back, pushing "b" out
    assert [cache.contains(k) for k in "abc"] == ["memory", "disk", "memory"]
    stats = cache.stats()
    assert (stats.disk_hits, stats.memory_hits, stats.misses) == (1, 0, 0)
    assert (stats.bytes_spilled, stats.bytes_loaded, stats.evictions, stats.drops) == (
        2 * VALUE_BYTES, VALUE_BYTES, 2, 0)
    # "a" kept its file when read back: pushing it out again writes nothing.
    cache.get("b")  # pushes "c" out: written
    spilled = cache.stats().bytes_spilled
    cache.get("c")  # pushes "a" out
    assert cache.contains("a") == "disk"
    assert cache.stats().bytes_spilled == spilled == 3 * VALUE_BYTES
    assert len(spill_files(tmp_path)) == 3


def test_the_disk_budget_drops_the_oldest_spill(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path), 2 * VALUE_BYTES)
    for i, key in enumerate("abcd"):
        cache.put(key, value(i))
    assert [cache.contains(k) for k in "abcd"] == [None, "disk", "disk", "memory"]
    assert len(spill_files(tmp_path)) == 2
    stats = cache.stats()
    assert (stats.evictions, stats.drops, stats.disk_values, stats.disk_bytes) == (3, 1, 2, 2 * VALUE_BYTES)


def test_a_value_over_the_disk_budget_is_dropped_when_pushed_out(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path), VALUE_BYTES - 1)
    cache.put("a", value(1))
    cache.put("b", value(2))
    assert cache.contains("a") is None
    assert spill_files(tmp_path) == []
    assert cache.stats().drops == 1


def test_a_value_over_the_memory_budget_is_refused():
    cache = ActivationCache(VALUE_BYTES - 1)
    with pytest.raises(ValueError, match="more than the cache's memory budget"):
        cache.put("big", value(1))
    assert cache.contains("big") is None
    assert cache.stats().memory_bytes == 0


def test_prefetch_brings_a_spill_into_memory_without_counting_a_get(tmp_path):
    cache = ActivationCache(2 * VALUE_BYTES, str(tmp_path))
    for i, key in enumerate("abc"):
        cache.put(key, value(i))
    assert cache.prefetch("a") is True  # pushes "b" out
    assert cache.prefetch("nope") is False
    stats = cache.stats()
    assert (stats.memory_hits, stats.disk_hits, stats.misses, stats.bytes_loaded) == (0, 0, 0, VALUE_BYTES)
    assert_equal(cache.get("a"), value(0))
    assert cache.stats().memory_hits == 1


def test_prefetch_of_a_value_in_memory_keeps_it_there():
    cache = ActivationCache(2 * VALUE_BYTES)
    cache.put("a", value(1))
    cache.put("b", value(2))
    assert cache.prefetch("a") is True  # its edit is coming: "b" is the one to go
    cache.put("c", value(3))
    assert [cache.contains(k) for k in "abc"] == ["memory", None, "memory"]


def test_put_replaces_the_value_in_memory_and_on_disk(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path))
    cache.put("a", value(1))
    cache.put("b", value(2))
    assert cache.contains("a") == "disk"
    cache.put("a", value(3))  # "b" goes to disk, the old "a" file is gone
    assert_equal(cache.get("a"), value(3))
    assert len(spill_files(tmp_path)) == 1
    stats = cache.stats()
    assert (stats.memory_bytes, stats.disk_bytes, stats.drops) == (VALUE_BYTES, VALUE_BYTES, 0)


def test_file_names_are_safe_for_any_key(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path / "spills"))
    keys = ["../../etc/passwd", "a/b c:*?", "é" * 300]
    for i, key in enumerate(keys + ["last"]):
        cache.put(key, value(i))
    assert os.listdir(tmp_path) == ["spills"]
    assert all(len(name) == len("0" * 64 + ".safetensors") for name in spill_files(tmp_path / "spills"))
    for i, key in enumerate(keys):
        assert_equal(cache.get(key), value(i))


def test_views_are_held_compact_and_can_be_spilled(tmp_path):
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    views = {"strided": base[:, ::2], "slice": base[:1], "again": base[:1]}  # the last two share memory
    nbytes = sum(t.nbytes for t in views.values())
    cache = ActivationCache(nbytes, str(tmp_path))
    cache.put("a", views)
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes for t in cache.get("a").values())
    assert cache.stats().memory_bytes == nbytes
    cache.put("b", {"x": torch.zeros(nbytes // 4)})
    assert cache.contains("a") == "disk"
    assert_equal(cache.get("a"), {k: v.contiguous() for k, v in views.items()})


def test_the_returned_dict_is_the_callers():
    cache = ActivationCache(VALUE_BYTES)
    cache.put("a", value(1))
    cache.get("a").clear()
    assert_equal(cache.get("a"), value(1))


def test_a_new_cache_clears_the_spills_of_an_earlier_one(tmp_path):
    (tmp_path / "notes.txt").write_text("not ours")
    first = ActivationCache(VALUE_BYTES, str(tmp_path))
    first.put("a", value(1))
    first.put("b", value(2))
    assert len(spill_files(tmp_path)) == 2
    ActivationCache(VALUE_BYTES, str(tmp_path))
    assert spill_files(tmp_path) == ["notes.txt"]


def test_a_load_whose_key_was_replaced_meanwhile_returns_the_new_value(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path))
    cache.put("a", value(1))
    cache.put("b", value(2))
    load = cache.begin_get("a")
    assert isinstance(load, PendingLoad)
    tensors = read_spilled(load)
    cache.put("a", value(3))
    assert_equal(cache.finish_load(load, tensors), value(3))


def test_a_load_whose_spill_was_dropped_meanwhile_is_a_miss(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path), VALUE_BYTES)
    cache.put("a", value(1))
    cache.put("b", value(2))
    load = cache.begin_get("a")
    tensors = read_spilled(load)
    cache.put("c", value(3))  # "b" spills, "a" leaves the disk
    assert cache.finish_load(load, tensors) is None
    assert cache.contains("a") is None
    assert cache.stats().misses == 1


def test_an_unreadable_spill_is_forgotten_as_a_miss(tmp_path):
    cache = ActivationCache(VALUE_BYTES, str(tmp_path))
    cache.put("a", value(1))
    cache.put("b", value(2))
    (name,) = spill_files(tmp_path)
    (tmp_path / name).write_bytes(b"not a safetensors file")
    assert cache.get("a") is None
    assert cache.contains("a") is None
    assert spill_files(tmp_path) == []
    stats = cache.stats()
    assert (stats.misses, stats.disk_bytes, stats.drops) == (1, 0, 1)


def test_budgets_are_checked():
    with pytest.raises(ValueError):
        ActivationCache(0)
    with pytest.raises(ValueError):
        ActivationCache(1, None, 10)
    with pytest.raises(TypeError):
        ActivationCache(100).put("a", {"x": [1.0]})
