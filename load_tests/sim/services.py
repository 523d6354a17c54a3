"""The text encoder and the VAE decoder as queueing servers, shaped like their deployments.

Text encoder (`deployments/text_encoder.py`): each replica batches with Ray Serve's
`@serve.batch` (a batch opens when the first item is taken, closes when full or after
`batch_wait_s`, and one batch runs at a time) and keeps an LRU cache of embeddings by
(model, text) (`TextCache`, which a worker that encodes prompts keeps too), so a batch only
pays for texts it has not seen. VAE decoder
(`deployments/vae_decoder.py`): each replica decodes one image at a time, in arrival order.
Requests go to the replica with the least outstanding work (lowest index on ties), a
deterministic stand-in for Serve's power-of-two-choices routing.

Both take their time through `run_work(seconds, callback, *args)`: a plain delay when the
component has a device of its own, or a job on the simulated `SharedHost` when it shares CPUs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stepserve.load_tests.sim.events import EventQueue

# (solo seconds of work, callback, *args): call back once the work is done.
RunWork = Callable[..., None]


@dataclass(frozen=True)
class TextEncoderSpec:
    replicas: int = 1  # 0: each worker encodes the prompts of what it admits (`text_encoder.on_workers`)
    max_batch_size: int = 16  # TextEncoderConfig defaults
    batch_wait_s: float = 0.002
    cache_size: int = 4096  # per replica, or per worker

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.max_batch_size < 1 or self.batch_wait_s < 0 or self.cache_size < 0:
            raise ValueError(f"bad text encoder spec {self}")


class TextCache:
    """`engine.text_encoding.CachedTextEncoder`'s LRU, without the embeddings."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()

    def encode(self, model: str, texts: Sequence[str]) -> int:
        """How many of `texts` one call encodes (the distinct ones not cached); caches them all."""
        missing = sum(1 for t in dict.fromkeys(texts) if (model, t) not in self._keys)
        for text in texts:
            self._keys[(model, text)] = None
            self._keys.move_to_end((model, text))
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)
        return missing


class _EncoderReplica:
    def __init__(self, cache_size: int) -> None:
        self.queue: deque[tuple[str, str, tuple[str, ...]]] = deque()  # (request id, model, texts)
        self.state = "idle"  # idle | collecting | running
        self.generation = 0  # invalidates a pending close timer once the batch closed early
        self.cache = TextCache(cache_size)

    @property
    def outstanding(self) -> int:
        return len(self.queue) + (self.state == "running")


class TextEncoderService:
    def __init__(self, spec: TextEncoderSpec, events: EventQueue, run_work: RunWork,
                 encode_seconds: Callable[[str, int], float],
                 on_ready: Callable[[Sequence[str]], None]) -> None:
        self.spec = spec
        self.events = events
        self.run_work = run_work
        self.encode_seconds = encode_seconds
        self.on_ready = on_ready
        if spec.replicas < 1:
            raise ValueError(f"a text encoder service needs replicas >= 1, got {spec.replicas}")
        self.replicas = [_EncoderReplica(spec.cache_size) for _ in range(spec.replicas)]
        self.busy_s = 0.0
        self.batches = 0

    def submit(self, request_id: str, model: str, texts: tuple[str, ...]) -> None:
        replica = min(self.replicas, key=lambda r: r.outstanding)
        replica.queue.append((request_id, model, texts))
        if replica.state == "idle":
            self._open(replica)
        elif replica.state == "collecting" and len(replica.queue) >= self.spec.max_batch_size:
            self._close(replica, replica.generation)

    def _open(self, replica: _EncoderReplica) -> None:
        replica.state = "collecting"
        replica.generation += 1
        if len(replica.queue) >= self.spec.max_batch_size:
            self._close(replica, replica.generation)
        else:
            self.events.at(self.events.now + self.spec.batch_wait_s, self._close, replica, replica.generation)

    def _close(self, replica: _EncoderReplica, generation: int) -> None:
        if replica.state != "collecting" or generation != replica.generation:
            return
        batch = [replica.queue.popleft() for _ in range(min(len(replica.queue), self.spec.max_batch_size))]
        seconds = 0.0
        for model in dict.fromkeys(m for _, m, _ in batch):
            missing = replica.cache.encode(model, [t for _, m, ts in batch if m == model for t in ts])
            if missing:
                seconds += self.encode_seconds(model, missing)
        replica.state = "running"
        self.busy_s += seconds
        self.batches += 1
        self.run_work(seconds, self._done, replica, tuple(rid for rid, _, _ in batch))

    def _done(self, replica: _EncoderReplica, request_ids: tuple[str, ...]) -> None:
        replica.state = "idle"
        if replica.queue:
            self._open(replica)
        self.on_ready(request_ids)


class _DecoderReplica:
    def __init__(self) -> None:
        self.queue: deque[tuple[str, float]] = deque()  # (request id, seconds)
        self.running = False

    @property
    def outstanding(self) -> int:
        return len(self.queue) + self.running


class DecoderService:
    def __init__(self, replicas: int, events: EventQueue, run_work: RunWork,
                 on_done: Callable[[str, float], None]) -> None:
        if replicas < 1:
            raise ValueError(f"decoder replicas must be >= 1, got {replicas}")
        self.events = events
        self.run_work = run_work
        self.on_done = on_done  # (request id, decode start time)
        self.replicas = [_DecoderReplica() for _ in range(replicas)]
        self.busy_s = 0.0

    def submit(self, request_id: str, seconds: float) -> None:
        replica = min(self.replicas, key=lambda r: r.outstanding)
        replica.queue.append((request_id, seconds))
        if not replica.running:
            self._start(replica)

    def _start(self, replica: _DecoderReplica) -> None:
        request_id, seconds = replica.queue.popleft()
        replica.running = True
        self.busy_s += seconds
        self.run_work(seconds, self._done, replica, request_id, self.events.now)

    def _done(self, replica: _DecoderReplica, request_id: str, started: float) -> None:
        replica.running = False
        if replica.queue:
            self._start(replica)
        self.on_done(request_id, started)
