"""The activation cache (InstGenIE §4.2): a template image's cached activations in host memory,
spilled least-recently-used to local disk under byte budgets, and brought back before the edit
that needs them runs.

A value is one template's activations, `{name: tensor}` (names such as "3.11", step 3 block 11,
are opaque here), under a string key. Ray-free and single-threaded: `ActivationStore` wraps it
in an actor and a lock. A read from disk takes seconds for a real template, so loading is split
in two (`begin_get`/`begin_prefetch`, then `read_spilled`, then `finish_load`) and the actor
runs the middle part without holding its lock; `get` and `prefetch` here do all three in a row.

Values are shared, not copied: `put` keeps the tensors it is given (when already compact CPU
tensors) and `get` hands out the held tensors, so neither side may change them afterwards (a
GiB-sized template copied on every edit would cost what the cache saves).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

Where = Literal["memory", "disk"]
Activations = dict[str, torch.Tensor]

# What a spilled value's file is called: the key's SHA-256, so any key makes a safe file name.
_SPILL_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache started. Each `get` counts one of `memory_hits`, `disk_hits`
    (read back from disk) and `misses`; a prefetch counts none, only its `bytes_loaded`. Bytes
    are tensor bytes (a file adds a small header)."""

    memory_hits: int
    disk_hits: int
    misses: int
    memory_values: int
    memory_bytes: int
    disk_values: int
    disk_bytes: int
    bytes_loaded: int  # read back from disk, by gets and prefetches
    bytes_spilled: int  # written to disk
    evictions: int  # values pushed out of memory (to disk, or dropped when there is no disk)
    drops: int  # values gone from the cache altogether (no disk, no room on disk, or pushed off it)


@dataclass(frozen=True)
class PendingLoad:
    """A disk read to do: `read_spilled` it (no cache state needed), then `finish_load`.
    `generation` tells whether the file is still the one the cache means when the read ends."""

    key: str
    path: str
    generation: int
    requested: bool  # by a get (counted as a hit or a miss) or by a prefetch (not counted)


@dataclass(frozen=True)
class _Held:
    tensors: Activations
    nbytes: int
    generation: int  # which `put` of the key this value is


@dataclass(frozen=True)
class _Spilled:
    nbytes: int
    generation: int


def read_spilled(load: PendingLoad) -> Activations | None:
    """The value in `load`'s file; None when it is gone or unreadable (the cache then forgets it)."""
    try:
        return load_file(load.path)
    except (OSError, SafetensorError) as exc:
        logger.warning("activation cache: cannot read %s for %r: %s", load.path, load.key, exc)
        return None


def _compact(tensors: Mapping[str, torch.Tensor]) -> Activations:
    """CPU tensors each laid out contiguously over exactly its own bytes, so the budget counts
    what is really held and safetensors can write them (it refuses tensors sharing memory).
    Tensors that already are so are kept, not copied."""
    compact: Activations = {}
    storages = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError("activations are {str: torch.Tensor}, got "
                            f"{type(name).__name__}: {type(tensor).__name__}")
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage()
        if not tensor.is_contiguous() or storage.nbytes() != tensor.nbytes or storage.data_ptr() in storages:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        storages.add(tensor.untyped_storage().data_ptr())
        compact[name] = tensor
    return compact


def _clear_spills(disk_dir: str) -> None:
    """Files spilled by an earlier cache in `disk_dir` (a restarted actor): their keys are not
    known, so they could never be read, and would fill the disk outside the budget."""
    for name in os.listdir(disk_dir):
        if _SPILL_NAME.fullmatch(name):
            os.remove(os.path.join(disk_dir, name))


class ActivationCache:
    def __init__(self, memory_bytes: int, disk_dir: str | None = None, disk_bytes: int | None = None):
        """`memory_bytes`: the host-memory budget; a value larger than it is refused.
        `disk_dir`: where values pushed out of memory go (None: they are dropped); the folder
        belongs to this cache, spills of an earlier one there are removed. `disk_bytes`: the disk
        budget (None: unbounded)."""
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
        if disk_bytes is not None and (disk_dir is None or disk_bytes < 0):
            raise ValueError("disk_bytes needs a disk_dir and must not be negative")
        self.memory_budget = memory_bytes
        self.disk_dir = disk_dir
        self.disk_budget = disk_bytes
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
            _clear_spills(disk_dir)
        # Least recently used first. A value read back from disk keeps its file (values never
        # change under a key), so pushing it out of memory again writes nothing.
        self._memory: OrderedDict[str, _Held] = OrderedDict()
        self._disk: OrderedDict[str, _Spilled] = OrderedDict()
        self._generation = 0
        self._counts = dict.fromkeys(("memory_hits", "disk_hits", "misses", "memory_bytes", "disk_bytes",
                                      "bytes_loaded", "bytes_spilled", "evictions", "drops"), 0)

    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hold `tensors` under `key` as the most recently used value, replacing what the key
        held (in memory and on disk). Raises ValueError if they exceed the memory budget."""
        value = _compact(tensors)
        nbytes = sum(t.nbytes for t in value.values())
        if nbytes > self.memory_budget:
            raise ValueError(f"activations for {key!r} take {nbytes} bytes, more than the cache's memory budget "
                             f"of {self.memory_budget}")
        self._forget(key)
        self._generation += 1
        self._hold(key, _Held(value, nbytes, self._generation))

    def get(self, key: str) -> Activations | None:
        """The value under `key` (now the most recently used), read back from disk if it is only
        there; None on a miss. Callers must not change the tensors."""
        found = self.begin_get(key)
        if isinstance(found, PendingLoad):
            return self.finish_load(found, read_spilled(found))
        return found

    def prefetch(self, key: str) -> bool:
        """Bring `key`'s value into memory if it is on disk, and mark it recently used (its edit
        is coming); whether it is in memory now."""
        load = self.begin_prefetch(key)
        if load is not None:
            self.finish_load(load, read_spilled(load))
        return key in self._memory

    def contains(self, key: str) -> Where | None:
        """Where the value under `key` is (memory first), without counting or touching it."""
        if key in self._memory:
            return "memory"
        return "disk" if key in self._disk else None

    def stats(self) -> CacheStats:
        return CacheStats(memory_values=len(self._memory), disk_values=len(self._disk), **self._counts)

    def begin_get(self, key: str) -> Activations | PendingLoad | None:
        """A get's first half: the value on a memory hit, None on a miss (both counted), else
        the disk read to do (counted by `finish_load`)."""
        held = self._memory.get(key)
        if held is not None:
            self._memory.move_to_end(key)
            self._counts["memory_hits"] += 1
            return dict(held.tensors)
        spilled = self._disk.get(key)
        if spilled is None:
            self._counts["misses"] += 1
            return None
        return PendingLoad(key, self._path(key), spilled.generation, requested=True)

    def begin_prefetch(self, key: str) -> PendingLoad | None:
        """A prefetch's first half: the disk read to do, if the value is on disk only (a value
        in memory is marked recently used instead)."""
        if key in self._memory:
            self._memory.move_to_end(key)
            return None
        spilled = self._disk.get(key)
        return None if spilled is None else PendingLoad(key, self._path(key), spilled.generation, requested=False)

    def finish_load(self, load: PendingLoad, tensors: Activations | None) -> Activations | None:
        """Hold what `read_spilled(load)` returned in memory and return it. Between the halves
        the key may have been loaded by another read (its value is returned), or replaced or
        pushed off the disk (the read is stale: a miss); an unreadable file is forgotten."""
        held = self._memory.get(load.key)
        if held is not None:
            self._memory.move_to_end(load.key)
            self._count(load, "memory_hits")
            return dict(held.tensors)
        spilled = self._disk.get(load.key)
        if spilled is None or spilled.generation != load.generation:
            self._count(load, "misses")
            return None
        if tensors is None:
            self._drop_from_disk(load.key)
            self._count(load, "misses")
            return None
        self._disk.move_to_end(load.key)
        self._counts["bytes_loaded"] += spilled.nbytes
        self._count(load, "disk_hits")
        self._hold(load.key, _Held(tensors, spilled.nbytes, spilled.generation))
        return dict(tensors)

    def _count(self, load: PendingLoad, counter: str) -> None:
        if load.requested:
            self._counts[counter] += 1

    def _path(self, key: str) -> str:
        return os.path.join(self.disk_dir, hashlib.sha256(key.encode()).hexdigest() + ".safetensors")

    def _hold(self, key: str, held: _Held) -> None:
        self._memory[key] = held
        self._counts["memory_bytes"] += held.nbytes
        # The newest value fits the budget alone, so it is never the one pushed out.
        while self._counts["memory_bytes"] > self.memory_budget:
            old_key, old = self._memory.popitem(last=False)
            self._counts["memory_bytes"] -= old.nbytes
            self._counts["evictions"] += 1
            self._spill(old_key, old)

    def _spill(self, key: str, held: _Held) -> None:
        """Keep a value pushed out of memory on disk, if there is one and it has room."""
        spilled = self._disk.get(key)
        if spilled is not None:  # read back earlier: its file is still there
            self._disk.move_to_end(key)
            return
        if self.disk_dir is None or (self.disk_budget is not None and held.nbytes > self.disk_budget):
            self._counts["drops"] += 1
            return
        while self.disk_budget is not None and self._counts["disk_bytes"] + held.nbytes > self.disk_budget:
            self._drop_from_disk(next(iter(self._disk)))
        path = self._path(key)
        try:  # written aside and renamed: a read in flight sees the old file or the whole new one
            save_file(held.tensors, path + ".tmp")
            os.replace(path + ".tmp", path)
        except (OSError, SafetensorError) as exc:
            logger.warning("activation cache: cannot spill %r to %s, dropping it: %s", key, path, exc)
            self._counts["drops"] += 1
            return
        self._disk[key] = _Spilled(held.nbytes, held.generation)
        self._counts["disk_bytes"] += held.nbytes
        self._counts["bytes_spilled"] += held.nbytes

    def _drop_from_disk(self, key: str) -> None:
        spilled = self._disk.pop(key)
        self._counts["disk_bytes"] -= spilled.nbytes
        if key not in self._memory:
            self._counts["drops"] += 1
        self._remove_file(key)

    def _forget(self, key: str) -> None:
        """Remove what `key` held before a new value replaces it (not an eviction nor a drop)."""
        held = self._memory.pop(key, None)
        if held is not None:
            self._counts["memory_bytes"] -= held.nbytes
        spilled = self._disk.pop(key, None)
        if spilled is not None:
            self._counts["disk_bytes"] -= spilled.nbytes
            self._remove_file(key)

    def _remove_file(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:  # removed by hand: the cache forgets it all the same
            pass
