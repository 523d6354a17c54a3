"""Loading a masked forward's cached block activations from host memory beside its computation
(InstGenIE §4.2, Fig. 9).

A template's activations live in host memory (tens of GiB per node do not fit in HBM). A masked
forward needs block b's cached output only when it reaches block b, so on CUDA a `BlockLoader`
issues every used block's host-to-device copy at once, in block order, on a side stream, each
followed by an event; the forward asks for block b (`loader(b)`, a `MaskedPlan.cached`) and the
compute stream waits on that block's event alone. The side stream runs the copies back to back,
so block i's copy ends after the first i copies, and block i's compute starts when both its copy
and block i-1 are done: the recurrence `policies.instgenie.pipeline_dp.pipeline_latency` plans
with. Blocks whose `use_cache` is off are never loaded (the DP chose to compute them in full).

`naive` loads every used block before the first block computes (Fig. 9-top): the copies are
queued on the compute stream itself, so the computation waits for the last of them.

On CPU the computation reads host memory itself, so nothing is copied, unless the blocks come
from a slower tier: a record spilled to the activation store's disk (`record_file.RecordFile`).
`threaded` then reads them as the side stream copies on CUDA: one background thread reads every
used block in block order (the reads release the GIL), and the forward waits for block b's read
alone; `naive` reads them all before the first block computes.

Copies are asynchronous only from pinned (page-locked) host memory: from pageable memory CUDA
stages them through a pinned buffer and the host waits, so the loader still works, but the
copies no longer overlap anything. `pin` makes a template's pinned copy once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

# Block b's cached output [rows, L, H], or several row groups of it (one per request of a batch,
# concatenated along rows on the device, so no unpinned host concatenation is made).
HostBlock = torch.Tensor | Sequence[torch.Tensor]
HostBlocks = Callable[[int], HostBlock] | Sequence[HostBlock]

K = TypeVar("K")


def pin(tensors: Mapping[K, torch.Tensor]) -> dict[K, torch.Tensor]:
    """Page-locked host copies of `tensors` (those already pinned are kept as they are), for a
    template to be pinned once, when it enters host memory, not once per edit.

    Cost: one host allocation through CUDA (`cudaHostAlloc`, far slower than malloc: the pages
    are locked one by one, a few GB/s) and one copy of every tensor; the memory cannot be swapped,
    so pinned templates count against the node's RAM in full. Without a CUDA driver nothing is
    pinned (there is no device copy to speed up) and the tensors are returned as they are."""
    if not torch.cuda.is_available():
        return dict(tensors)
    return {key: t if t.is_pinned() else _pinned_copy(t) for key, t in tensors.items()}


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    # empty + copy_ rather than `pin_memory()`: this also takes device tensors, in one copy.
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


class BlockLoader:
    """One masked forward's cached block outputs on `device`: `loader(b)` is block b's [rows, L, H].

    Construction starts the loading (see the module docstring), so make it right before the
    forward and use it for that forward only. Each used block is handed out once: its device
    tensor is dropped here then, so blocks already computed free their memory during the forward.
    On CPU nothing is copied: `loader(b)` returns the host tensor, fetched from `host` when asked
    (or, `naive`, every used block's first; `threaded`, by a background thread in block order:
    for a `host` that reads from disk)."""

    def __init__(self, host: HostBlocks, use_cache: Sequence[bool], device: torch.device | str,
                 naive: bool = False, threaded: bool = False):
        self._host = host if callable(host) else host.__getitem__
        self._use_cache = tuple(bool(u) for u in use_cache)
        self._device = torch.device(device)
        if threaded and self._device.type != "cpu":
            raise ValueError(f"threaded loading is for a CPU computation reading from disk, not {self._device}")
        # block -> (its tensor on the device, the side stream's event after its copy, or None
        # where the copy is ordered with the computation already).
        self._loaded: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        # Threaded: block -> set once its read ended (or failed: `_failure`).
        self._read: dict[int, threading.Event] = {}
        self._failure: BaseException | None = None
        used = [b for b, use in enumerate(self._use_cache) if use]
        if naive:
            for b in used:  # on CUDA, on the compute stream: block 0 waits for every copy
                self._loaded[b] = (self._fetch(b), None)
        elif self._device.type == "cuda":
            stream = torch.cuda.Stream(self._device)
            # Allocated on the side stream (the caching allocator ties a block to the stream that
            # allocates it); `__call__` records the compute stream's use before handing it out.
            with torch.cuda.stream(stream):
                for b in used:
                    tensor = self._fetch(b)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self._loaded[b] = (tensor, event)
        elif threaded:
            events = {b: threading.Event() for b in used}
            self._read = dict(events)  # the forward pops its copy; the thread keeps `events`
            threading.Thread(target=self._read_in_order, args=(events,), name="block-loader", daemon=True).start()
        self._lazy = not naive and not threaded and self._device.type != "cuda"

    def _read_in_order(self, events: dict[int, threading.Event]) -> None:
        for b, event in events.items():  # in block order
            try:
                self._loaded[b] = (self._fetch(b), None)
            except BaseException as exc:  # handed to the forward, which waits on this block or a later one
                self._failure = exc
                for waiting in events.values():
                    waiting.set()
                return
            event.set()

    def __call__(self, block: int) -> torch.Tensor:
        if not self._use_cache[block]:
            raise ValueError(f"block {block} does not use its cache: its activations are not loaded")
        read = self._read.pop(block, None)
        if read is not None:
            read.wait()
            if block not in self._loaded and self._failure is not None:
                raise RuntimeError(f"reading block {block}'s cached activations failed") from self._failure
        if block not in self._loaded:
            if self._lazy:
                return self._fetch(block)
            raise ValueError(f"block {block}'s activations were handed out already")
        tensor, event = self._loaded.pop(block)
        if event is not None:
            compute = torch.cuda.current_stream(self._device)
            compute.wait_event(event)
            # Freed later, the block must not be reused by the side stream's next allocation
            # before the compute stream's kernels reading it are done.
            tensor.record_stream(compute)
        return tensor

    def _fetch(self, block: int) -> torch.Tensor:
        """Block `block`'s host tensor(s) on the device, copied on the current stream (as one
        tensor: row groups are concatenated)."""
        found = self._host(block)
        parts = [found] if isinstance(found, torch.Tensor) else list(found)
        if self._device.type != "cuda":  # no stream to load on; on CPU `to` returns the tensor itself
            parts = [p.to(self._device) for p in parts]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device=self._device)
        first = 0
        for part in parts:
            # Asynchronous only from pinned memory; from pageable memory CUDA makes the host wait.
            out[first : first + part.shape[0]].copy_(part, non_blocking=part.is_pinned())
            first += part.shape[0]
        return out
