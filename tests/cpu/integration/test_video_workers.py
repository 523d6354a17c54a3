"""Plans on real Ray denoiser workers: two workers join a gloo world; a video starts on one,
pauses to host memory, resumes sequence-parallel over both, pauses again and ends alone on the
other, and equals an uninterrupted run on one worker. Inputs that cannot be had fail only their
own requests, saying whether the state was lost."""

import dataclasses
import time

import numpy as np
import pytest
import ray
import torch

from stepserve.actors.denoiser import AdmissionRef
from stepserve.actors.pool import WorkerLauncher
from stepserve.actors.worker_options import WorkerPoolSpec, WorkerServices
from stepserve.engine.families import TEXT, load_family
from stepserve.policies.types import RequestProgress, StepGroup, StepReport, WorkerPlan
from stepserve.runtime import start_local_ray

from tests.tiny_video import TINY_WAN, UNEVEN, make_video_spec, video_embeds

ATOL = 2e-5  # as test_ulysses: a split sequence changes GEMM shapes (and so rounding) only


@pytest.fixture(scope="module")
def workers():
    started = not ray.is_initialized()
    start_local_ray(num_cpus=2, object_store_mb=128)
    # One torch thread each: the two workers share the machine's cores. No CPU reservation, so
    # they can be placed even in a Ray whose CPUs another fixture's app already holds.
    pool = WorkerPoolSpec(num_workers=2, num_cpus=0, device="cpu", torch_threads=1)
    launcher = WorkerLauncher(pool, [TINY_WAN], "video-test", WorkerServices())
    handles = [launcher.start()[3] for _ in range(pool.num_workers)]
    try:
        ray.get([w.ready.remote() for w in handles])
        init_method = ray.get(handles[0].sp_rendezvous.remote(True))
        assert init_method.startswith("file://")  # one node: nothing listens
        ray.get([w.join_sp_world.remote(init_method, rank, len(handles)) for rank, w in enumerate(handles)])
        yield handles
    finally:
        # Bounded: a worker stuck in a collective would never answer; killing it is enough then.
        ray.wait([w.leave_sp_world.remote() for w in handles], num_returns=len(handles), timeout=30)
        for w in handles:
            ray.kill(w)
        if started:
            ray.shutdown()


@pytest.fixture(scope="module")
def embeds(workers):
    spec = make_video_spec(**UNEVEN)
    return ray.put(video_embeds(load_family(TINY_WAN, {TEXT}, "cpu"), spec))


def send(worker, plan: WorkerPlan, admissions=()) -> list:
    """The plan's refs, as the router gets them: the report's, then one per output."""
    refs = worker.execute.options(num_returns=1 + len(plan.outputs)).remote(plan, tuple(admissions))
    return refs if plan.outputs else [refs]


def test_a_video_moves_between_degrees_and_workers_and_equals_uninterrupted(workers, embeds):
    w0, w1 = workers
    spec = make_video_spec(**UNEVEN)  # 27 tokens (uneven shards), CFG, 4 steps
    rid = spec.request_id
    alone, both = (StepGroup((rid,), ranks=(0,)),), (StepGroup((rid,), ranks=(0, 1)),)
    incarnations = ray.get([w.ready.remote() for w in workers])
    assert len(set(incarnations)) == 2

    # The reference: all four steps on w0 alone; the last plan checkpoints, then finishes.
    reference = dataclasses.replace(spec, request_id="reference")
    ref_step = (StepGroup(("reference",), ranks=(0,)),)
    ray.get(send(w0, WorkerPlan("w0", admit=("reference",), groups=ref_step), [AdmissionRef(reference, embeds)]))
    for _ in range(2):
        ray.get(send(w0, WorkerPlan("w0", groups=ref_step)))
    plan = WorkerPlan("w0", groups=ref_step, checkpoint=("reference",), finish=("reference",), plan_id=3)
    report, ref_state, ref_frames = ray.get(send(w0, plan))
    assert (report.plan_id, report.incarnation, report.failed) == (3, incarnations[0], ())
    assert ref_frames.shape == (9, 48, 48, 3) and ref_frames.dtype == np.uint8

    # Step 1 on w0 alone (SP 1), then pause: the state goes to host memory on w0.
    report_ref, state = send(w0, WorkerPlan("w0", admit=(rid,), groups=alone, export=(rid,)),
                             [AdmissionRef(spec, embeds)])
    # Steps 2-3 over both workers (SP 2): each resumes its own copy from the same state, which
    # goes worker to worker as an object ref, never through this driver.
    resume = [AdmissionRef(spec, state, resume=True)]
    first = [send(w, WorkerPlan(w_id, admit=(rid,), groups=both), resume) for w, w_id in zip(workers, ("w0", "w1"))]
    second = [send(w0, WorkerPlan("w0", groups=both, export=(rid,))), send(w1, WorkerPlan("w1", groups=both,
                                                                                           release=(rid,)))]
    reports = ray.get([refs[0] for refs in (*first, *second)])
    assert all(r.failed == () for r in reports)
    assert [r.progress for r in reports] == [(RequestProgress(rid, 2, 4),)] * 2 + [(RequestProgress(rid, 3, 4),)] * 2
    paused = second[0][1]
    # Step 4 on w1 alone (SP 1 again), where it finishes.
    ray.get(send(w1, WorkerPlan("w1", admit=(rid,)), [AdmissionRef(spec, paused, resume=True)]))
    report, final, frames = ray.get(send(w1, WorkerPlan("w1", groups=(StepGroup((rid,), ranks=(1,)),),
                                                        checkpoint=(rid,), finish=(rid,))))
    assert report.failed == () and report.incarnation == incarnations[1]
    assert ray.get(report_ref).progress == (RequestProgress(rid, 1, 4),)

    torch.testing.assert_close(final["latents"], ref_state["latents"], atol=ATOL, rtol=0)
    assert frames.shape == (9, 48, 48, 3) and frames.dtype == np.uint8
    assert np.abs(frames.astype(int) - ref_frames.astype(int)).max() <= 1
    # w0 let it go at its export: stepping it there now finds its state lost.
    (report,) = ray.get(send(w0, WorkerPlan("w0", groups=alone)))
    assert isinstance(report, StepReport) and [(f.request_id, f.lost) for f in report.failed] == [(rid, True)]
    assert "not resident on worker video-test-w0" in report.failed[0].message


@ray.remote(num_cpus=0)
def refused_prompt():
    raise ValueError("the prompt was refused")


@ray.remote(num_cpus=0)
class Owner:
    def put(self, value):
        return [ray.put(value)]  # in a list, so the ref (owned by this actor) comes back unresolved



def test_inputs_that_cannot_be_had_fail_only_their_request(workers, embeds):
    w0, _ = workers
    owner = Owner.remote()
    [orphan] = ray.get(owner.put.remote(ray.get(embeds)))
    ray.kill(owner)  # the owner of the object dies: it is lost, once Ray has noticed
    # `ray.kill` returns before the actor is gone, and its objects go a moment after it: until
    # then the orphan still resolves (from this node's object store), so wait for that.
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(orphan, timeout=10)
        except ray.exceptions.ObjectLostError:  # OwnerDiedError among them
            break
        assert time.monotonic() < deadline, "the killed owner's object never became unavailable"
        time.sleep(0.1)
    ok, refused, lost, stale = (make_video_spec(rid, steps=2) for rid in ("ok", "refused", "lost", "stale"))
    admissions = [AdmissionRef(ok, embeds), AdmissionRef(refused, refused_prompt.remote()),
                  AdmissionRef(lost, orphan), AdmissionRef(stale, orphan, resume=True)]
    plan = WorkerPlan("w0", admit=("ok", "refused", "lost", "stale"), groups=(StepGroup(("ok", "refused")),),
                      release=("ok",))
    (report,) = ray.get(send(w0, plan, admissions))
    assert report.progress == (RequestProgress("ok", 1, 2),)
    assert {f.request_id: f.lost for f in report.failed} == {"refused": False, "lost": True, "stale": True}
    messages = {f.request_id: f.message for f in report.failed}
    assert messages["refused"] == "text encoding failed: ValueError: the prompt was refused"
    assert messages["lost"].startswith("text encoding failed:") and messages["stale"].startswith("state unavailable:")


def test_an_interrupt_ends_a_running_plan_after_its_current_step(workers, embeds):
    """The control call runs beside the plan (its own concurrency group), so the worker stops
    at the next step boundary and keeps the request, which then finishes in a later plan."""
    w0, _ = workers
    spec = dataclasses.replace(make_video_spec(**UNEVEN), request_id="long", num_inference_steps=200)
    alone = (StepGroup(("long",), ranks=(0,)),)
    plan = WorkerPlan("w0", admit=("long",), groups=alone, finish=("long",), steps=200, plan_id=7001)
    report_ref, output_ref = send(w0, plan, [AdmissionRef(spec, embeds)])
    time.sleep(0.3)  # it is stepping by now (200 steps take seconds)
    started = time.perf_counter()
    ray.get(w0.interrupt.remote(plan.plan_id))  # answered while the plan runs
    report = ray.get(report_ref, timeout=60)
    assert time.perf_counter() - started < 2.0
    assert 1 <= report.steps_run < 200 and report.failed == ()
    assert report.progress == (RequestProgress("long", report.steps_run, 200),)
    assert ray.get(output_ref) is None  # not finished: still resident
    # Another plan's id does not stop this one; the rest of the steps finish it.
    w0.interrupt.remote(plan.plan_id)
    left = 200 - report.steps_run
    rest = WorkerPlan("w0", groups=alone, finish=("long",), steps=left, plan_id=7002)
    report_ref, output_ref = send(w0, rest)
    report = ray.get(report_ref, timeout=120)
    assert report.steps_run is None and report.failed == ()
    assert ray.get(output_ref).shape[0] == spec.num_frames
