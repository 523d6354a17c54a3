"""In-process doubles for driving the real `Ingress` without Ray.

Only the router is a test double (the live integration tests run the real one); the job store
is the real `JobStore`, called through the same handle shape (`store.method.remote(...)`).
"""

import asyncio
import inspect
import pickle
import time
from contextlib import contextmanager
from collections import Counter
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import ray.exceptions
import ray.serve
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from stepserve.actors.replica_metrics import ReplicaSums
from stepserve.actors.router import MAX_RESUMES, RequestCancelledError
from stepserve.deployments import ingress as ingress_module
from stepserve.deployments.config import AppConfig
from stepserve.deployments.job_store import JobStore
from stepserve.policies.admission import LoadReport
from stepserve.policies.types import RequestSpec
from stepserve.routing.core import DuplicateRequestError

# What the text of a Ray failure carries; no response body may ever show any of it.
NODE_IP, ACTOR_ID, PID = "10.0.0.7", "4f2c9e1d7a", 4242
LEAKY_TEXT = (f'Traceback (most recent call last):\n  File "/srv/stepserve/actors/router.py", line 99, in submit\n'
              f"RuntimeError: actor {ACTOR_ID} on node {NODE_IP} (pid={PID}) lost its worker")
LEAKS = ("Traceback", NODE_IP, ACTOR_ID, "/srv/stepserve", "lost its worker")

CONFIG = {
    "models": [
        {"name": "tiny-sd", "preset": "tiny", "default_size": "128x128", "max_size": 512},
        {"name": "tiny-wan", "family": "wan", "preset": "tiny", "default_size": "64x64", "min_size": 16,
         "max_size": 128, "max_pixels": 128 * 128, "default_steps": 4, "max_steps": 20, "default_guidance_scale": 5.0,
         "default_num_frames": 9, "max_num_frames": 17, "default_fps": 8, "max_fps": 30},
    ],
    "limits": {"max_body_bytes": 4096},
}

# The class as written, under Serve's ASGI wrapper (whose async __init__/__del__ need a replica).
INGRESS = next(c for c in ingress_module.Ingress.__mro__ if "http_generate" in vars(c))


def settle(coro: Any) -> Any:
    """Run a coroutine that never suspends (every JobStore method) to its result, with or
    without an event loop running in this thread."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coroutine suspended; it needs an event loop")


class Method:
    """`handle.method.remote(...)` in process, as a Serve handle call behaves: dispatched at once
    (awaited or not), arguments and results cross a pickle, and an exception arrives as Ray
    delivers it: a RayTaskError that is also an instance of its cause and whose text holds the
    remote traceback, node IP and actor id."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple] = []

    def remote(self, *args: Any) -> asyncio.Future:
        args = pickle.loads(pickle.dumps(args))
        self.calls.append(args)
        return asyncio.ensure_future(self._call(args))

    async def _call(self, args: tuple) -> Any:
        try:
            result = self.fn(*args)
            if inspect.isawaitable(result):
                result = await result
        except ray.exceptions.RayError:
            raise  # Ray's own failures (a dead actor) arrive unwrapped
        except Exception as exc:
            raise ray.exceptions.RayTaskError(self.fn.__name__, LEAKY_TEXT, exc, ip=NODE_IP, pid=PID,
                                              actor_id=ACTOR_ID).as_instanceof_cause() from None
        return pickle.loads(pickle.dumps(result))


class StoreHandle:
    """The real JobStore's async methods behind `store.method.remote(...)`."""

    def __init__(self, store: JobStore):
        self.target = store
        for name, member in inspect.getmembers(store, inspect.iscoroutinefunction):
            if not name.startswith("_"):
                setattr(self, name, Method(member))


class ManualClock:
    """The job store's wall clock, moved by the test."""

    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_png(spec: RequestSpec) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + f"{spec.request_id}/{spec.seed}".encode()


def video_frames(spec: RequestSpec) -> np.ndarray:
    shape = (spec.num_frames, spec.height, spec.width, 3)
    return np.random.default_rng(spec.seed).integers(0, 256, shape, dtype=np.uint8)


class FakeRouter:
    """The router's public methods as the ingress calls them; requests move only when the test
    says (`step`, `finish`, `fail`, `restart`; images finish at once unless `hold_images`).

    Like the real router it joins a resubmitted live id with an equal spec (images), refuses
    one with another spec, forgets a request once it ends, and reports a video's end to the job
    store (`complete` with its frames, `set_status` when failed or cancelled). Unlike the real
    router, a cancelled video's status is in the store before `cancel` answers.
    """

    def __init__(self, store: JobStore):
        self.store = store
        self.specs: dict[str, RequestSpec] = {}  # every spec accepted, by request id
        self.submitted: list[str] = []  # request ids accepted, in order
        self.live: dict[str, dict[str, Any]] = {}  # progress of what the router holds now
        self.cancelled: list[str] = []  # live ids that `cancel` stopped
        self.refuse: Exception | None = None  # raised by every submit while set
        self.hold_images = False
        self._images: dict[str, asyncio.Future] = {}
        self.report = LoadReport(version=0, live_workers=1)
        self.load_error: Exception | None = None
        self.received: dict[str, Counter] = {}  # gate id -> requests of each class received from it
        self.readiness_state = {"workers": 2, "live_workers": 2, "queued": 0, "running": 0}
        self.metrics = b"# TYPE stepserve_router_rounds counter\nstepserve_router_rounds 7\n"
        self.ingress = ReplicaSums()  # the real sum of the ingress replicas' pushes
        for name in ("submit", "submit_video", "cancel", "progress", "load", "readiness", "metrics_text",
                     "ingress_metrics"):
            setattr(self, name, Method(getattr(self, f"_{name}")))

    # -- the router's methods ----------------------------------------------------------------

    async def _submit(self, spec: RequestSpec, inputs: list | None = None, gate: str | None = None) -> bytes:
        self._arrived(gate, spec)
        rid = spec.request_id
        waiter = self._images.get(rid)
        if waiter is None or self.specs[rid] != spec:
            self._accept(spec)
            waiter = self._images[rid] = asyncio.get_running_loop().create_future()
            if not self.hold_images:
                self.release(rid)
        return await asyncio.shield(waiter)

    def _submit_video(self, spec: RequestSpec, gate: str | None = None) -> None:
        self._arrived(gate, spec)
        self._accept(spec)

    def _cancel(self, rid: str) -> bool:
        if rid not in self.live:
            return False
        self._forget(rid)
        self.cancelled.append(rid)
        if self.specs[rid].is_video:
            settle(self.store.set_status(rid, "cancelled"))
        else:
            self._images.pop(rid).set_exception(RequestCancelledError(f"request {rid} was cancelled"))
        return True

    def _progress(self, rid: str) -> dict[str, Any] | None:
        return dict(self.live[rid]) if rid in self.live else None

    async def _load(self, version: int = -1, gate: str | None = None, timeout_s: float = 30.0) -> LoadReport:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.load_error is not None:
                raise self.load_error
            if self.report.version != version or time.monotonic() >= deadline:
                return replace(self.report, received=dict(self.received.get(gate, {})))
            await asyncio.sleep(0.005)

    def _readiness(self) -> dict[str, int]:
        return dict(self.readiness_state)

    def _metrics_text(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(self.ingress)
        return self.metrics + generate_latest(registry)

    def _ingress_metrics(self, replica: str, sequence: int, families: tuple) -> None:
        self.ingress.update(replica, sequence, families)

    # -- what the test drives ------------------------------------------------------------------

    def release(self, rid: str) -> None:
        """An image finishes: its PNG goes to every caller waiting for it."""
        self._forget(rid)
        self._images.pop(rid).set_result(fake_png(self.specs[rid]))

    def step(self, vid: str, steps: int = 1, status: str = "running", sp_degree: int = 1, pauses: int = 0) -> None:
        job = self.live[vid]
        job.update(status=status, steps_done=min(job["steps_total"], job["steps_done"] + steps), sp_degree=sp_degree,
                   pauses=pauses)

    def finish(self, vid: str) -> bool:
        """The video is denoised and decoded: its frames go to the job store."""
        self._forget(vid)
        return settle(self.store.complete(vid, video_frames(self.specs[vid])))

    def fail(self, vid: str) -> None:
        self._forget(vid)
        error = {"code": "generation_failed", "message": "video generation failed"}  # what the router stores
        settle(self.store.set_status(vid, "failed", error))

    def restart(self) -> list[str]:
        """A new router replica: it knows nothing of the old one's requests and, starting up,
        runs the unfinished jobs in the store again, as the real router does (up to
        `MAX_RESUMES` times; this fake from the start, whatever their checkpoints). Returns the ids
        it resumed."""
        self.live.clear()
        resumed = settle(self.store.resume_unfinished(
            MAX_RESUMES, f"the job was interrupted by a router restart {MAX_RESUMES + 1} times; create it again"))
        for record, _ in resumed:
            self._accept(record.spec)
        return [record.job_id for record, _ in resumed]

    def publish(self, **changes: Any) -> LoadReport:
        """A new load report (the version moves on), as the router publishes one on every change."""
        fields = {"live_workers": self.report.live_workers, "classes": self.report.classes, **changes}
        self.report = LoadReport(version=self.report.version + 1, **fields)
        return self.report

    def _arrived(self, gate: str | None, spec: RequestSpec) -> None:
        if gate is not None:
            self.received.setdefault(gate, Counter())[spec.kind.lane] += 1

    def _accept(self, spec: RequestSpec) -> None:
        if self.refuse is not None:
            raise self.refuse
        if spec.request_id in self.live:
            raise DuplicateRequestError(spec.request_id)
        self.specs[spec.request_id] = spec
        self.submitted.append(spec.request_id)
        self.live[spec.request_id] = {"status": "queued", "steps_done": 0, "steps_total": spec.num_inference_steps,
                                      "sp_degree": 0, "pauses": 0, "recoveries": 0, "degrees": []}

    def _forget(self, rid: str) -> None:
        self.live.pop(rid, None)


class FakeTextEncoder:
    def __init__(self):
        self.alive = True
        self.ready = Method(self._ready)

    def _ready(self) -> bool:
        if not self.alive:
            raise ray.exceptions.RayActorError()
        return True


@dataclass
class App:
    config: AppConfig
    clock: ManualClock
    store: JobStore
    router: FakeRouter
    text_encoder: FakeTextEncoder
    ingress: Any


def build(clock: ManualClock | None = None, **overrides: Any) -> App:
    """An ingress over the real job store (sized by the config's `jobs`, on `clock`) and a fake router."""
    config = AppConfig.model_validate({**CONFIG, **overrides})
    clock = clock or ManualClock()
    store = JobStore(config.jobs.ttl_s, config.jobs.max_bytes, config.jobs.max_jobs, clock=clock)
    router, text_encoder = FakeRouter(store), FakeTextEncoder()
    ingress = INGRESS(config, router, StoreHandle(store), text_encoder)
    return App(config, clock, store, router, text_encoder, ingress)


def point_serve_at(ingress: Any, monkeypatch: Any) -> None:
    """Serve's class-based routes find their `self` through
    `serve.get_replica_context().servable_object`: make it this ingress."""
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(servable_object=ingress))


@contextmanager
def http_client(ingress: Any, monkeypatch: Any):
    """HTTP against the real FastAPI app, served by `ingress`. One event loop for the whole
    block (in TestClient's thread), so the admission gate's watcher lives across requests."""
    point_serve_at(ingress, monkeypatch)
    with TestClient(ingress_module.api, raise_server_exceptions=False) as client:
        yield client


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    """For what happens on TestClient's event loop, in its own thread (the gate's watcher)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def assert_error(response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error with this status and code (and param, when given)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_no_leak(response) -> str:
    """A 5xx that names its request id (body and x-request-id header) and nothing of the failure."""
    assert 500 <= response.status_code <= 599, response.text
    text = response.text + str(dict(response.headers))
    for secret in LEAKS:
        assert secret not in text, (secret, text)
    request_id = response.headers["x-request-id"]
    assert response.json()["error"]["message"].endswith(f"(request id: {request_id})")
    return request_id
