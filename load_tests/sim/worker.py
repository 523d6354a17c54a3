"""A simulated denoiser worker: `engine/step_runner.StepRunner` with the tensors taken out.

It executes `WorkerPlan`s exactly as the real runner does (drop, admit, then one forward per
group, skipping requests no longer resident, e.g. ones that finished in an earlier pipelined
plan), tracks each resident request's steps, and answers with a real `StepReport`. Time comes
from the cost model: a plan takes `cost.round_seconds` of the groups that actually ran.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from stepserve.policies.types import RequestProgress, RequestSpec, StepReport, WorkerPlan

# (model, height, width, rows) of each group that ran -> seconds
RoundCost = Callable[[tuple[tuple[str, int, int, int], ...]], float]


class _Resident:
    __slots__ = ("done", "total", "model", "height", "width", "rows")

    def __init__(self, spec: RequestSpec) -> None:
        self.done = 0
        self.total = spec.num_inference_steps
        self.model, self.height, self.width = spec.model, spec.height, spec.width
        self.rows = 2 if spec.uses_cfg else 1


class SimWorker:
    def __init__(self, worker_id: str, round_cost: RoundCost) -> None:
        self.worker_id = worker_id
        self.round_cost = round_cost
        self.resident: dict[str, _Resident] = {}
        self.rounds = 0

    def execute(self, plan: WorkerPlan, specs: Mapping[str, RequestSpec]) -> StepReport:
        for rid in plan.drop:
            self.resident.pop(rid, None)
        touched: list[str] = []
        failed: list[tuple[str, str]] = []
        for rid in plan.admit:
            if rid in self.resident:
                failed.append((rid, "admission failed: already resident"))
                continue
            self.resident[rid] = _Resident(specs[rid])
            touched.append(rid)
        shapes: list[tuple[str, int, int, int]] = []
        for group in plan.groups:
            present = [rid for rid in group if rid in self.resident]
            if not present:
                continue
            members = [self.resident[rid] for rid in present]
            head = members[0]
            shapes.append((head.model, head.height, head.width, sum(m.rows for m in members)))
            for member in members:
                member.done += 1
            touched.extend(present)
        progress: list[RequestProgress] = []
        finished: list[str] = []
        for rid in dict.fromkeys(touched):
            state = self.resident.get(rid)
            if state is None:
                continue
            progress.append(RequestProgress(rid, state.done, state.total))
            if state.done >= state.total:
                finished.append(rid)
                del self.resident[rid]
        duration = self.round_cost(tuple(shapes)) if shapes else 0.0
        self.rounds += 1
        return StepReport(
            worker_id=self.worker_id, progress=tuple(progress), finished=tuple(finished), failed=tuple(failed),
            duration_s=duration, batch_size=len(plan.stepping),
        )
