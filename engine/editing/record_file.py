"""One tensor at a time from a template record spilled to disk (InstGenIE §4.2, on a CPU host).

On a GPU node a template's activations wait in host memory and load over PCIe; on a CPU node the
computation reads host memory directly, and the tier that must be loaded is the activation
store's disk (`actors.activation_cache` spills records there as safetensors files). A
`RecordFile` reads one slot of such a file into a fresh tensor with `os.preadv`, which releases
the GIL for the read, so a `BlockLoader` thread can read block b+1 while the computation runs
block b. `safetensors.torch.load_file` reads the whole file at once instead.

`read(name, cold=True)` first drops that slot's pages from the page cache
(`posix_fadvise(DONTNEED)`), so the read goes to the disk as it would for a record that has not
been read since it was spilled: what a benchmark or a cost measurement of loading from disk
wants. Pages are dropped only where they are clean (the file is written once, then only read).
"""

from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple

import torch

# safetensors' dtype names (its format spec) for the dtypes records are kept in.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


class _Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


class RecordFile:
    """A safetensors file opened for reads by name; close it (or use `with`) when done."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._entries = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _read_header(self) -> dict[str, _Entry]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) != 8:
            raise ValueError(f"{self.path}: not a safetensors file (no header length)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"{self.path}: header of {length} bytes in a file of {size}")
        header = json.loads(os.pread(self._fd, length, 8))
        header.pop("__metadata__", None)
        base = 8 + length
        entries = {}
        for name, info in header.items():
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {info['dtype']}, not one of {sorted(DTYPES)}")
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end <= size - base:
                raise ValueError(f"{self.path}: tensor {name!r} lies outside the file")
            entries[name] = _Entry(DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, end - begin)
        return entries

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def nbytes(self, name: str) -> int:
        return self._entry(name).nbytes

    def read(self, name: str, cold: bool = False) -> torch.Tensor:
        """Tensor `name`, read from the file into new memory; `cold`: from the disk, not from
        pages the kernel kept (see the module docstring)."""
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if out.nbytes != entry.nbytes:
            raise ValueError(f"{self.path}: tensor {name!r} has {entry.nbytes} bytes for shape {entry.shape} "
                             f"of {entry.dtype}")
        if cold:
            os.posix_fadvise(self._fd, entry.offset, entry.nbytes, os.POSIX_FADV_DONTNEED)
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy()) if entry.nbytes else memoryview(b"")
        done = 0
        while done < entry.nbytes:  # a read may return fewer bytes than asked
            got = os.preadv(self._fd, [buffer[done:]], entry.offset + done)
            if got == 0:
                raise OSError(f"{self.path}: file ended inside tensor {name!r}")
            done += got
        return out

    def drop_cached_pages(self) -> None:
        """Drop the whole file's clean pages from the page cache: the next reads go to the disk."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "RecordFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
