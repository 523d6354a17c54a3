"""A simulated denoiser worker: `engine/step_runner.StepRunner` with the tensors taken out.

It executes `WorkerPlan`s in the real runner's order (drop, admit, one forward per group
`plan.steps` times over, export / checkpoint / finish, release), tracks each resident
request's steps, and answers with a real `StepReport` plus one token per `plan.outputs` entry
(a `SimState` for exported and checkpointed state, the request id for a finished output). It
fails a request exactly where the real runner does (not resident, resuming from a state that is
not ready), so the core's fault handling can be driven by it too. Time comes from the cost
model: a plan takes the cost of the groups that really ran (`cost.round_seconds`) for each of
its steps, plus the decode of what it finishes that decodes here (`decode_cost`: a video
always, an image when the workers decode images), after encoding the prompts of the fresh
starts it admits when the workers encode prompts (`encode_cost`) and bringing the LoRAs its
admissions need that it does not hold (`lora_load_cost`, kept as the live worker keeps them). A plan starts (`start`: drops,
admissions) when the worker would start it and ends (`end`: steps, outputs, report) when its
time is up, or after fewer steps when the router cut it short.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stepserve.load_tests.sim.synerdiff import WorkerSequencer
from stepserve.policies.cost_model import BatchShape
from stepserve.policies.types import RequestFailure, RequestProgress, RequestSpec, StepReport, WorkerPlan
from stepserve.routing.lora_residency import LoraResidency


@dataclass(frozen=True)
class SimState:
    """A request's exported state: which request, and how many steps it holds."""

    request_id: str
    steps_done: int


@dataclass(frozen=True)
class SimAdmission:
    spec: RequestSpec
    state: SimState | None  # None: a fresh start


class _Resident:
    __slots__ = ("spec", "done")

    def __init__(self, spec: RequestSpec, done: int) -> None:
        self.spec = spec
        self.done = done


# (batches that ran) -> seconds of the round
RoundCost = Callable[[tuple[BatchShape, ...]], float]
DecodeCost = Callable[[RequestSpec], float]
# (the fresh starts one plan admits) -> seconds to encode their prompts
EncodeCost = Callable[[Sequence[RequestSpec]], float]


class _Running:
    """A plan between its start (drops and admissions done, the forwards' shapes known) and its
    end (steps counted, outputs and report made)."""

    __slots__ = ("plan", "failed", "touched", "groups", "shapes", "head_s", "step_s", "tail_s", "decodes")

    def __init__(self, plan: WorkerPlan) -> None:
        self.plan = plan
        self.failed: dict[str, RequestFailure] = {}
        self.touched: list[str] = []
        self.groups: list[list[_Resident]] = []  # the members of each forward that runs
        self.shapes: tuple[BatchShape, ...] = ()  # and what each forward is
        self.head_s = 0.0  # before its first step: encoding the prompts of what it admits
        self.step_s = 0.0  # one step's seconds: the cost of its forwards
        self.tail_s = 0.0  # after its last step: the decode of what it finishes here
        # With a SynerDiff sequencer: the decodes that end during its steps (request id, seconds
        # from the first step's start).
        self.decodes: list[tuple[str, float]] = []


class SimWorker:
    def __init__(self, worker_id: str, round_cost: RoundCost, decode_cost: DecodeCost,
                 incarnation: str = "sim", encode_cost: EncodeCost | None = None,
                 lora_load_cost: Callable[[str], float] | None = None, lora_resident: int = 32,
                 sequencer: WorkerSequencer | None = None) -> None:
        """`encode_cost`: None, prompts come encoded (the text encoder deployment).
        `lora_load_cost(model)`: bringing one LoRA it lacks into its memory (None: free).
        `sequencer`: SynerDiff's (`sim.synerdiff`): the images it finishes decode in its lane,
        beside its later rounds, which it prices (`decode_cost` is then 0 for an image)."""
        self.worker_id = worker_id
        self.round_cost = round_cost
        self.decode_cost = decode_cost
        self.encode_cost = encode_cost
        self.lora_load_cost = lora_load_cost
        self.sequencer = sequencer
        self.loras = LoraResidency(lora_resident)
        self.lora_loads = 0  # LoRAs brought in
        self.incarnation = incarnation
        self.resident: dict[str, _Resident] = {}
        self.rounds = 0

    def execute(self, plan: WorkerPlan, admissions: Mapping[str, SimAdmission],
                steps_run: int | None = None) -> tuple[StepReport, list, float]:
        """Run a plan (cut short after `steps_run` steps if given); returns (report, output
        tokens aligned with plan.outputs, seconds)."""
        return self.end(self.start(plan, admissions), steps_run)

    def start(self, plan: WorkerPlan, admissions: Mapping[str, SimAdmission]) -> _Running:
        """Drop, admit, and find what each forward runs; `end` does the rest. The whole plan takes
        `head_s`, then `step_s` a step, then `tail_s`."""
        running = _Running(plan)
        failed, touched = running.failed, running.touched
        for rid in plan.drop:
            self.resident.pop(rid, None)
        for rid in plan.admit:
            admission = admissions.get(rid)
            if admission is None or rid in self.resident:
                failed[rid] = RequestFailure(rid, "admission failed")
                continue
            self.resident[rid] = _Resident(admission.spec, 0 if admission.state is None else admission.state.steps_done)
            touched.append(rid)
        if self.encode_cost is not None:
            fresh = [self.resident[rid].spec for rid in touched if admissions[rid].state is None]
            running.head_s = self.encode_cost(fresh) if fresh else 0.0
        running.head_s += self._bring_loras([self.resident[rid].spec for rid in touched])
        shapes: list[BatchShape] = []
        for group in plan.groups:
            members = []
            for rid in group.request_ids:
                if rid in self.resident:
                    members.append(self.resident[rid])
                    touched.append(rid)
                elif rid not in failed:
                    failed[rid] = RequestFailure(rid, f"request {rid} is not resident on {self.worker_id}", lost=True)
            if not members:
                continue
            shapes.append(BatchShape.of([m.spec for m in members], group))
            running.groups.append(members)
        running.shapes = tuple(shapes)
        running.step_s = self.round_cost(running.shapes) if shapes else 0.0
        if self.sequencer is not None and shapes:
            self.sequencer.observe_queue()
            times, running.decodes = self.sequencer.rounds([m for g in running.groups for m in g], plan.steps)
            running.step_s = sum(times) / len(times)
        running.tail_s = sum(self.decode_cost(self.resident[rid].spec) for rid in plan.finish
                             if rid in self.resident and rid not in failed)
        return running

    def _bring_loras(self, admitted: Sequence[RequestSpec]) -> float:
        """What the plan waits for the LoRAs its admissions bring that this worker lacks (the
        live worker installs them before the batch's first step)."""
        if not any(spec.loras for spec in admitted):
            return 0.0
        seconds = 0.0
        in_use = [(r.spec.model, use.name) for r in self.resident.values() for use in r.spec.loras]
        for spec in admitted:
            missing = self.loras.bring(((spec.model, use.name) for use in spec.loras), in_use)
            self.lora_loads += missing
            if missing and self.lora_load_cost is not None:
                seconds += missing * self.lora_load_cost(spec.model)
        return seconds

    def end(self, running: _Running, steps_run: int | None = None) -> tuple[StepReport, list, float]:
        """The plan's steps (all, or the first `steps_run`), outputs and report; what it was to
        finish stays resident if it was cut short before the last step."""
        plan, failed, touched = running.plan, running.failed, running.touched
        steps = plan.steps if steps_run is None else steps_run
        for members in running.groups:
            for member in members:
                member.done += steps
        seconds = running.head_s + running.step_s * steps
        outputs: list = []
        kept: set[str] = set()
        for rid in plan.outputs:
            resident = self.resident.get(rid)
            if resident is None or rid in failed:
                failed.setdefault(rid, RequestFailure(rid, f"request {rid} is not resident on {self.worker_id}",
                                                      lost=True))
                outputs.append(None)
            elif rid in plan.finish:
                if resident.done < resident.spec.steps_to_run:
                    if steps < plan.steps:
                        kept.add(rid)
                    else:
                        failed[rid] = RequestFailure(rid, "finish before the last step")
                    outputs.append(None)
                else:
                    seconds += self.decode_cost(resident.spec)
                    if self.sequencer is not None and not resident.spec.is_video:
                        self.sequencer.enqueue(rid, resident.spec)
                    outputs.append(rid)
            else:
                outputs.append(SimState(rid, resident.done))
        progress = tuple(RequestProgress(rid, self.resident[rid].done, self.resident[rid].spec.steps_to_run)
                         for rid in dict.fromkeys(touched) if rid in self.resident and rid not in failed)
        for rid in plan.export + plan.finish + plan.release:
            if rid not in kept:
                self.resident.pop(rid, None)
        for rid in failed:
            self.resident.pop(rid, None)
        self.rounds += 1
        report = StepReport(self.worker_id, plan.plan_id, progress, tuple(failed.values()), seconds,
                            len(plan.stepping), self.incarnation, None if steps == plan.steps else steps)
        return report, outputs, seconds
