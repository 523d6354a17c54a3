"""SynerDiff's VAE chunking on a denoiser worker (§III-B): finished images decode beside the
worker's denoising rounds, one sub-block of each per round, instead of stalling one round with
whole decodes.

The step runner hands the lane each image it finishes (`start`) and tells it when a denoising
round begins (`round`); neither waits for a decode. The decodes run in whichever thread waits for
a result (`wait`: the worker's decode call, beside its plans): at each round that thread runs the
next chunk of every pending decode, concurrently with the round's forward (on a GPU in a stream
of its own, so the memory-bound decode and the compute-bound forward share the device as in the
paper), and when no round has begun for `idle_s` (nothing is denoising) it runs on by itself.
Chunking changes when the work runs, not what it computes (`engine.vae_chunking`): the PNG is
the one a whole decode gives.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from stepserve.engine.png import encode_png


@dataclass(frozen=True)
class PendingDecode:
    """A finished image whose PNG its worker's lane is still decoding: ask the lane (`wait`) for it."""

    request_id: str


class DecodeLane:
    def __init__(self, chunks: int, idle_s: float = 0.05):
        """`chunks`: sub-blocks of each decode (one a round); `idle_s`: how long without a round
        begun before the waiting thread decodes on by itself."""
        if chunks < 1:
            raise ValueError(f"a decode runs in at least 1 chunk, got {chunks}")
        self.chunks = chunks
        self.idle_s = idle_s
        self._changed = threading.Condition()
        self._rounds = 0
        self._allowed: int | None = None  # how many decodes the last round carries (None: all)
        self._last_round = time.monotonic()
        self._pending: OrderedDict[str, tuple[Any, Any, torch.cuda.Stream | None]] = OrderedDict()
        self._done: dict[str, bytes | Exception] = {}
        self._running = threading.Lock()  # one thread runs chunks at a time

    @property
    def pending(self) -> tuple[str, ...]:
        """The requests still decoding, oldest first."""
        with self._changed:
            return tuple(self._pending)

    def start(self, rid: str, family: Any, latents: torch.Tensor, chunks: int | None = None) -> PendingDecode:
        """Queue the decode of finished image `rid` (its latents [1, C, h, w]) by `family`'s VAE, in
        `chunks` sub-blocks (None: the lane's; a worker's load controller raises them under load)."""
        stream = None
        if latents.device.type == "cuda":
            # The decode's stream starts after the work that made the latents, and everything the
            # decode makes (its input included) is made on it.
            stream = torch.cuda.Stream(latents.device)
            stream.wait_stream(torch.cuda.current_stream(latents.device))
            latents.record_stream(stream)
        with _on(stream):
            job = family.decode_in_chunks(latents.float(), chunks or self.chunks)
        with self._changed:
            self._pending[rid] = (family, job, stream)
            self._changed.notify_all()
        return PendingDecode(rid)

    def round(self, decodes: int | None = None) -> None:
        """A denoising round begins: each pending decode, or the oldest `decodes`, may run its
        next chunk (a sequencer's sub-round carries its share: `engine.round_sequencer`)."""
        with self._changed:
            self._allowed = decodes
            self._rounds += 1
            self._last_round = time.monotonic()
            self._changed.notify_all()

    def wait(self, rid: str, timeout_s: float | None = None) -> bytes:
        """`rid`'s PNG once decoded, running the lane meanwhile; raises what its decode raised."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            seen = self._rounds  # the round at which this thread last ran chunks: the next one runs the next
        while True:
            with self._changed:
                while rid not in self._done:
                    if rid not in self._pending:
                        raise KeyError(f"request {rid} is not decoding here")
                    idle = self.idle_s - (time.monotonic() - self._last_round)
                    if self._rounds != seen or idle <= 0:
                        break  # a new round began, or none for idle_s: run the next chunks
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"decoding {rid} took longer than {timeout_s} s")
                    self._changed.wait(idle)
                else:
                    result = self._done.pop(rid)
                    if isinstance(result, Exception):
                        raise result
                    return result
                allowed = self._allowed if self._rounds != seen else None  # idle: every decode
                seen = self._rounds
            self._run_chunks(allowed)

    def _run_chunks(self, allowed: int | None) -> None:
        """The next chunk of every pending decode, or of the oldest `allowed`."""
        with self._running:
            with self._changed:
                jobs = list(self._pending.items())[:allowed]
            for rid, (family, job, stream) in jobs:
                try:
                    with torch.inference_mode(), _on(stream):
                        job.step()
                        png = encode_png(family.decoded_pixels(job.result)[0]) if job.done else None
                except Exception as exc:  # one bad decode fails its request only
                    png = exc
                if png is None:
                    continue
                with self._changed:
                    del self._pending[rid]
                    self._done[rid] = png
                    self._changed.notify_all()


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
