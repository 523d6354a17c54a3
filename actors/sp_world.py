"""Process groups between denoiser workers, for sequence parallelism chosen round by round.

At startup every worker joins one `torch.distributed` world (gloo on CPU, NCCL on GPUs). The
router then picks, each round, which workers run a video together; `SPWorld.group` hands a
worker the process group for that rank set, and the engine receives it as an argument (never
the default group), so no parallel state leaks into callers.

Groups are created lazily with `use_local_synchronization=True`, so only the members of a rank
set take part in creating it (the other workers are busy with their own videos). torch names
such a group by a hash of its ranks and keys its rendezvous in the shared store under that
name, so a second `new_group` for the same rank set in one process is refused ("group name has
already been created") and could not reuse the stale store keys anyway: each distinct rank set
is therefore created at most once per process and cached for the life of the world. The first
step a rank set runs pays for creating its group (a store rendezvous among the members).

A collective waits for every member: a member that never makes its call leaves the others
blocked until `timeout_s`. A restarted worker has lost its world; the router must then have
every worker `close` and join a new world (a new rendezvous), since a world's size is fixed.

The world's store is where its members meet (`rendezvous`). When every worker is on one node it
is a file in a folder only this user can enter: nothing listens on the network. A world over
several nodes needs torch's TCP store, which listens on rank 0's node without authentication;
keep those nodes' ports off the network (k8s/networkpolicy.yaml).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import ray
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def rendezvous(one_node: bool) -> str:
    """Where a world's members meet (a torch `init_method`), made on the node of the worker that
    will be rank 0: a file store in a new folder of its own (mode 0700) when every member is on
    this node; else a TCP store at (node IP, free port). The port is only probed, so another
    process could take it before rank 0 binds it; joining then fails and can be retried."""
    if one_node:
        return f"file://{tempfile.mkdtemp(prefix='stepserve-sp-')}/store"
    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class SPWorld:
    """This process's membership of the workers' world, and the groups it has created."""

    def __init__(self, rank: int, world_size: int, backend: str, timeout: timedelta, folder: str | None = None):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self._folder = folder  # a file store's folder, removed once its last member has left
        self._groups: dict[tuple[int, ...], Any] = {}
        self._open = True

    @classmethod
    def join(cls, init_method: str, rank: int, world_size: int, backend: str = "gloo",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "SPWorld":
        """Blocks until all `world_size` ranks have joined at `init_method` (`rendezvous`; call
        it on every worker at once)."""
        if dist.is_initialized():
            # torch keeps one default group per process: a second world would replace it.
            raise RuntimeError("this process already belongs to a torch.distributed world; close it first")
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        folder = os.path.dirname(urlparse(init_method).path) if init_method.startswith("file://") else None
        return cls(rank, world_size, backend, timeout, folder)

    def group(self, ranks: Iterable[int]) -> Any | None:
        """The process group of `ranks` (world ranks, any order, this rank among them), or None
        for this rank alone. Every member must ask for the same set at the same time the first
        time, because creating a group is a rendezvous."""
        if not self._open:
            raise RuntimeError("this SP world is closed")
        key = tuple(sorted(ranks))
        if len(set(key)) != len(key):
            raise ValueError(f"ranks {key} repeat a rank")
        if not key or key[0] < 0 or key[-1] >= self.world_size:
            raise ValueError(f"ranks {key} are not all in a world of {self.world_size}")
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not in the group {key}")
        if len(key) == 1:
            return None
        group = self._groups.get(key)
        if group is None:
            group = dist.new_group(list(key), timeout=self.timeout, use_local_synchronization=True)
            self._groups[key] = group
        return group

    def close(self) -> None:
        """Leave the world (destroys every group this process holds). Safe to repeat."""
        if self._open and dist.is_initialized():
            dist.destroy_process_group()
        self._groups.clear()
        self._open = False
        if self._folder is not None:
            # torch deletes the store file when its last user closes it; the last to leave finds
            # the folder empty and removes it.
            with contextlib.suppress(OSError):
                os.rmdir(self._folder)
