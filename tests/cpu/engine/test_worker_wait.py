"""A worker reports how long it sat between two plans while it held requests (the hand-off the
router's metrics show as stepserve_worker_wait_seconds), and nothing when it held none."""

import time

from stepserve.actors.denoiser import DenoiserWorker
from stepserve.actors.worker_options import WorkerPoolSpec
from stepserve.policies.types import StepGroup, WorkerPlan
from stepserve.routing.core import AdmissionRef

from tests.tiny import TINY, make_spec


def test_the_wait_between_plans_is_reported_only_while_requests_are_resident():
    worker = DenoiserWorker("w0", [TINY], WorkerPoolSpec(device="cpu", encode_text=True, text_cache_size=8))
    spec = make_spec("a", steps=3)
    first = worker.execute(WorkerPlan("w0", admit=("a",), groups=(StepGroup(("a",)),), plan_id=1),
                           (AdmissionRef(spec, None),))
    assert first.failed == () and first.waited_s is None  # nothing was resident before it

    time.sleep(0.05)  # "a" is resident: this is a hand-off somebody waits through
    second = worker.execute(WorkerPlan("w0", groups=(StepGroup(("a",)),), plan_id=2))
    assert second.waited_s is not None and 0.05 <= second.waited_s < 5

    report, _ = worker.execute(WorkerPlan("w0", groups=(StepGroup(("a",)),), finish=("a",), release=("a",),
                                          plan_id=3))
    assert report.failed == () and report.waited_s < second.waited_s  # called at once: a short hand-off

    time.sleep(0.05)  # nothing resident: an idle worker's wait delays no one
    idle = worker.execute(WorkerPlan("w0", admit=("b",), plan_id=4), (AdmissionRef(make_spec("b", steps=1), None),))
    assert idle.waited_s is None
