"""The activation store: one actor per node holding its templates' cached activations
(`ActivationCache`: host memory, spilled to local disk), shared by the node's workers.

The router asks it to `prefetch` an edit's template while the edit waits in the queue (InstGenIE
§4.2: a disk read takes seconds, the queue wait usually covers it); the worker that runs the
edit then `get`s it from memory. The actor is threaded, so a prefetch's disk read runs beside
gets and puts: the cache is guarded by one lock, never held during a disk read.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch

from stepserve.actors.activation_cache import (
    ActivationCache, Activations, CacheStats, PendingLoad, Where, read_spilled,
)
from stepserve.actors.node_stores import start_per_node, stores_by_node

logger = logging.getLogger(__name__)

# Gets and puts from the node's workers, and the router's prefetch calls, at once.
MAX_CONCURRENCY = 8
# Reads of one key wait for each other (one read per template however many ask); reads of keys
# in different stripes run side by side.
READ_STRIPES = 16


@dataclass(frozen=True)
class ActivationStoreSpec:
    memory_bytes: int = 16 << 30
    disk_dir: str | None = None  # each node's store spills under its own folder here; None: no disk
    disk_bytes: int | None = None  # per node; None: unbounded


class ActivationStore:
    def __init__(self, memory_bytes: int, disk_dir: str | None = None, disk_bytes: int | None = None):
        """The budgets and folder of its `ActivationCache`."""
        self._cache = ActivationCache(memory_bytes, disk_dir, disk_bytes)
        self._lock = threading.Lock()
        self._reads = [threading.Lock() for _ in range(READ_STRIPES)]
        # One prefetch read at a time: they share the disk's bandwidth, so reading two templates
        # side by side only makes the first one later.
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="activation-prefetch")

    def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """See `ActivationCache.put` (raises ValueError for a value over the memory budget)."""
        with self._lock:
            self._cache.put(key, tensors)

    def get(self, key: str) -> Activations | None:
        """The value under `key`, read back from disk if need be (waiting for a prefetch of it
        that is under way); None on a miss."""
        with self._lock:
            found = self._cache.begin_get(key)
        if isinstance(found, PendingLoad):
            return self._load(key, self._cache.begin_get)
        return found

    def prefetch(self, keys: Sequence[str]) -> dict[str, Where | None]:
        """Start reading the values of `keys` that are on disk only into memory, in the
        background, and mark those in memory recently used. Returns at once, with where each
        key was: "disk" ones are on their way, None ones are not cached."""
        with self._lock:
            where = {key: self._cache.contains(key) for key in keys}
            reads = [key for key in where if self._cache.begin_prefetch(key) is not None]
        for key in reads:
            self._prefetcher.submit(self._load, key, self._cache.begin_prefetch).add_done_callback(_log_failure)
        return where

    def contains(self, key: str) -> Where | None:
        with self._lock:
            return self._cache.contains(key)

    def stats(self) -> CacheStats:
        with self._lock:
            return self._cache.stats()

    def _load(self, key: str, begin: Callable[[str], Any]) -> Activations | None:
        """Read `key` from disk without holding the lock. `begin` runs again under the key's
        stripe: a read of the key that ended meanwhile has made it a memory hit."""
        with self._reads[zlib.crc32(key.encode()) % READ_STRIPES]:
            with self._lock:
                found = begin(key)
            if not isinstance(found, PendingLoad):
                return found
            tensors = read_spilled(found)
            with self._lock:
                return self._cache.finish_load(found, tensors)


def _log_failure(future: Future) -> None:
    """A background read has no caller to raise to."""
    if future.exception() is not None:
        logger.error("activation store: a prefetch failed", exc_info=future.exception())


def start_activation_stores(spec: ActivationStoreSpec, name_prefix: str) -> dict[str, Any]:
    """One activation store per live node, by node id: the workers of a node share its store's
    host memory and disk. Each is a named actor, `<prefix>-activations-<node>-<token>`; it spills
    under `<disk_dir>/<prefix>-<node>`, the same folder after a restart (which clears it)."""
    def args_for(node_id: str) -> tuple:
        disk_dir = None if spec.disk_dir is None else os.path.join(spec.disk_dir, f"{name_prefix}-{node_id[:8]}")
        return spec.memory_bytes, disk_dir, spec.disk_bytes
    return start_per_node(ActivationStore, f"{name_prefix}-activations", args_for, max_concurrency=MAX_CONCURRENCY)


def node_store(stores: Mapping[str, Any]) -> Any:
    """The store of the node this process runs on (else any: see `stores_by_node`)."""
    return stores_by_node(stores, ray.get_runtime_context().get_node_id())


class StoreActivations:
    """A worker's `engine.template_edits.ActivationSource`: its node's store, behind a small LRU of
    the records this worker used last (`local`): a hot template's edits on one worker then skip
    the store's copy through the object store (hundreds of MB a record). A store that fails to
    answer makes the edit record its template again (exact), never fails it; records are put
    without waiting (the worker goes on stepping; the store takes them when it can)."""

    def __init__(self, store: Any, local: ActivationCache | None = None):
        self.store = store
        self.local = local

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        record = None if self.local is None else self.local.get(key)
        if record is not None:
            return record
        try:
            record = ray.get(self.store.get.remote(key))
        except Exception as exc:  # a restarting store has lost its templates anyway
            logger.warning("activation store unavailable, recording template %s again: %r", key, exc)
            return None
        if record is not None:
            self._keep(key, record)
        return record

    def put(self, key: str, activations: Mapping[str, torch.Tensor]) -> None:
        self.store.put.remote(key, dict(activations))
        self._keep(key, activations)

    def _keep(self, key: str, record: Mapping[str, torch.Tensor]) -> None:
        if self.local is None:
            return
        try:
            self.local.put(key, record)
        except ValueError:  # larger than the worker's share: the store keeps it alone
            pass
