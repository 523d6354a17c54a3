"""A synchronous driver for `RouterCore` tests: the core decides, `SimWorker`s (the StepRunner's
twin, tested against the real runner's behaviour in tests/cpu/engine) execute, reports return.
No clock, no events: time advances by a fixed tick per round, and each worker runs the oldest
plan it holds whenever the test says so (all of its steps, or as many as the test says after
the core interrupted it)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from stepserve.load_tests.sim.worker import SimAdmission, SimWorker
from stepserve.policies import make_policy
from stepserve.policies.types import LoraBatching, RequestKind, RequestSpec, WorkerPlan
from stepserve.routing.core import AdmissionRef, CoreConfig, Outcome, RouterCore, WorkerSlot

TICK = 0.01


class Handle:
    """What `send` returns: filled with the output once the plan ran (None if it never does)."""

    def __init__(self) -> None:
        self.value: Any = None


def spec(rid: str, steps: int = 3, size: int = 64, guidance: float = 7.5, model: str = "m", frames: int = 1,
         slo_s: float | None = None) -> RequestSpec:
    kind = RequestKind.T2V if frames > 1 else RequestKind.T2I
    return RequestSpec(rid, model, "p", size, size, steps, guidance, 0, kind=kind, num_frames=frames, slo_s=slo_s)


class Harness:
    def __init__(self, policy: Any = "continuous", options: dict | None = None, workers: int = 2, batch: int = 4,
                 depth: int = 2, costs: Any = None, checkpoint_interval_s: float | None = None,
                 max_queued: dict | None = None, max_recoveries: int = 3, lead_s: float = math.inf,
                 max_plan_s: float = 0.0, lora_batches: LoraBatching = LoraBatching.MIXED,
                 images_decode_on_workers: bool = False) -> None:
        scheduler = make_policy(policy, options, costs) if isinstance(policy, str) else policy
        config = CoreConfig(
            pipeline_depth=depth, pipeline_lead_s=lead_s, checkpoint_interval_s=checkpoint_interval_s,
            max_plan_s=max_plan_s,
            max_queued=max_queued or {RequestKind.T2I: 64, RequestKind.T2V: 64}, max_recoveries=max_recoveries,
            lora_batches=lora_batches, images_decode_on_workers=images_decode_on_workers)
        ids = [f"w{i}" for i in range(workers)]
        self.core = RouterCore(scheduler, [WorkerSlot(w, batch, i) for i, w in enumerate(ids)], config, costs)
        self.workers = {w: SimWorker(w, lambda shapes: TICK, lambda s: 0.0, incarnation=f"{w}-1") for w in ids}
        self.queues: dict[str, deque] = {w: deque() for w in ids}
        self.sent: list[WorkerPlan] = []
        self.interrupts: list[tuple[str, int]] = []  # (worker, plan id) the core asked to cut short
        self.outcomes: list[Outcome] = []
        self.now = 0.0

    def send(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...]) -> list[Handle]:
        handles = [Handle() for _ in plan.outputs]
        self.queues[plan.worker_id].append((plan, admissions, handles))
        self.sent.append(plan)
        return handles

    def submit(self, *specs: RequestSpec, ready: bool = True) -> None:
        for s in specs:
            self.core.submit(s, self.now)
            if ready:
                self.core.mark_ready(s.request_id, f"embeds-{s.request_id}", self.now)

    def interrupt(self, worker_id: str, plan_id: int) -> None:
        self.interrupts.append((worker_id, plan_id))

    def schedule(self):
        return self.core.schedule(self.now, self.send, self.interrupt)

    def execute(self, worker_id: str, steps_run: int | None = None) -> Outcome:
        """The worker runs its oldest plan (only `steps_run` of its steps, if given); the core
        applies the report."""
        plan, admissions, handles = self.queues[worker_id].popleft()
        resolved = {}
        for a in admissions:
            state = a.source.value if a.resume else None
            if a.resume and state is None:
                continue  # the state it resumes from was never produced: the worker reports it lost
            resolved[a.spec.request_id] = SimAdmission(a.spec, state)
        report, outputs, _ = self.workers[worker_id].execute(plan, resolved, steps_run)
        for handle, value in zip(handles, outputs):
            handle.value = value
        outcome = self.core.apply(report, self.now)
        self.outcomes.append(outcome)
        for rid, _ in outcome.denoised:
            self.core.complete(rid, self.now)
        return outcome

    def round(self, runs: Callable[[str], bool] = lambda worker_id: True) -> bool:
        """Schedule, then every worker that `runs` this round runs one plan (an interrupted one
        stops after its first step). False when nothing is left to do."""
        self.now += TICK
        self.schedule()
        busy = [w for w, q in self.queues.items() if q]
        for w in busy:
            if not runs(w):
                continue
            plan = self.queues[w][0][0]
            self.execute(w, 1 if (w, plan.plan_id) in self.interrupts and plan.steps > 1 else None)
        return bool(busy)

    def run(self, max_rounds: int = 2000) -> int:
        for n in range(max_rounds):
            if not self.round() and not any(self.queues.values()):
                if not self.round():
                    return n
        raise AssertionError("the run did not settle")

    def status(self, rid: str):
        return self.core.state(rid).status

    def drive(self, arrivals: list[tuple[int, RequestSpec]], cancels: dict[int, str], runs: Callable[[str], bool],
              check: Callable[[Any], None], ticks: int = 3000) -> None:
        """A random run: each tick submits the `arrivals` ((tick, spec)) and `cancels` ({tick: id})
        due then, and runs a round in which a worker runs its plan when `runs` says so (plans stay
        in flight across arrivals: cuts happen); `check` sees the snapshot after every round. Ends
        once every request is terminal (after tick 40)."""
        for tick in range(ticks):
            for t, s in arrivals:
                if t == tick:
                    self.submit(s)
            if tick in cancels:
                self.core.cancel(cancels[tick], self.now)
            self.round(runs)
            check(self.core.snapshot(self.now))
            if tick > 40 and all(self.core.state(s.request_id).status.is_terminal for _, s in arrivals):
                return
