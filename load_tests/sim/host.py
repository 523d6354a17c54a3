"""A CPU host shared by every component of a deployment: processor sharing over its cores.

On a GPU cluster each worker owns its device, and a round's time is the profile's. On a CPU
box the workers, the router, the HTTP proxy, the ingress, the text encoder and the VAE decoder
all run on the same few cores: with two single-threaded workers on two cores, every request's
HTTP handling, every router round and every decode takes CPU time from a worker round. Measured
on the 2-core VM, the rest of the app used 0.7 cores at 5 req/s, and the workers' rounds took
1.8x their solo profile (load_tests/README.md, "Simulator vs live").

The model: a job is single-threaded CPU work of known solo duration (the profile's number).
While n jobs run on c cores each advances at min(1, c / n) of its solo speed (Linux's fair
share for threads of equal weight), divided by the host's slowdown with min(n, c) cores busy:
busy cores slow each other through shared caches and memory bandwidth, and a VM's vCPUs may be
hyperthread siblings (the profile's host_probe rows measure it; 1.4-2.2x on the 2-core VM).
When a job ends or starts, every other job's speed changes.

The rest of the machine is a `background` of cores' worth of demand that never ends (what the
idle app and the OS burn, the profile's host_idle): it counts as that fraction of one more
job, so n jobs advance at min(1, c / (n + background)). It takes nothing from a lone job on a
box with a core to spare, but slows every job once the cores are all wanted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from stepserve.load_tests.sim.events import EventQueue

# Jobs within this much work (seconds) of the first to end end with it: floating-point dust
# from repeated speed changes must not leave a job a few ulps short, forever rescheduled.
_EPS = 1e-9


class SharedHost:
    def __init__(self, cpus: float, events: EventQueue, slowdown: Callable[[int], float] | None = None,
                 background: float = 0.0) -> None:
        if not cpus > 0:
            raise ValueError(f"host cpus must be > 0, got {cpus}")
        if not background >= 0:
            raise ValueError(f"host background must be >= 0 cores, got {background}")
        self.cpus = cpus
        self.background = background
        self.events = events
        self.slowdown = slowdown or (lambda busy: 1.0)
        self._cores = max(1, math.floor(cpus))
        self._speeds: dict[int, float] = {}
        self._jobs: dict[int, list[Any]] = {}  # id -> [remaining solo seconds, callback, args, total]
        self._next_id = 0
        self._last = 0.0  # when `remaining` was last brought up to date
        self._token = 0  # invalidates the completion event scheduled before the last change
        self.work_s = 0.0  # solo seconds of work submitted
        self.peak_jobs = 0

    @property
    def running(self) -> int:
        return len(self._jobs)

    def _speed(self) -> float:
        n = len(self._jobs)
        if not n:
            return 0.0
        if n not in self._speeds:
            self._speeds[n] = min(1.0, self.cpus / (n + self.background)) / self.slowdown(min(n, self._cores))
        return self._speeds[n]

    def run(self, work_s: float, callback: Callable[..., None], *args: Any) -> int | None:
        """Do `work_s` seconds of solo CPU work, then call `callback(*args)`. Returns the job's
        id (None for no work: the callback runs at once)."""
        if work_s < 0:
            raise ValueError(f"work must be >= 0 s, got {work_s}")
        self.work_s += work_s
        if work_s == 0:
            self.events.at(self.events.now, callback, *args)
            return None
        self._advance()
        job = self._next_id
        self._jobs[job] = [work_s, callback, args, work_s]
        self._next_id += 1
        self.peak_jobs = max(self.peak_jobs, len(self._jobs))
        self._reschedule()
        return job

    def done_s(self, job: int) -> float:
        """Solo seconds of a running job's work done by now."""
        self._advance()
        remaining, _, _, total = self._jobs[job]
        return total - remaining

    def resize(self, job: int, work_s: float) -> None:
        """Make a running job `work_s` seconds of work in all (at least what it has done)."""
        self._advance()
        entry = self._jobs[job]
        done = entry[3] - entry[0]
        self.work_s += work_s - entry[3]
        entry[0], entry[3] = max(work_s - done, 0.0), work_s
        self._reschedule()

    def _advance(self) -> None:
        now = self.events.now
        done = (now - self._last) * self._speed()
        if done > 0:
            for job in self._jobs.values():
                job[0] -= done
        self._last = now

    def _reschedule(self) -> None:
        self._token += 1
        if self._jobs:
            first = min(job[0] for job in self._jobs.values())
            self.events.at(self.events.now + max(first, 0.0) / self._speed(), self._complete, self._token)

    def _complete(self, token: int) -> None:
        if token != self._token:
            return
        self._advance()
        # Nothing changed since this event was scheduled, so the first job is done by now.
        cutoff = min(job[0] for job in self._jobs.values()) + _EPS
        finished = [jid for jid, job in self._jobs.items() if job[0] <= cutoff]
        callbacks = [self._jobs.pop(jid)[1:3] for jid in finished]
        self._reschedule()
        for callback, args in callbacks:  # in submission order: ids increase
            callback(*args)
