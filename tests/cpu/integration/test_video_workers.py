"""Video jobs on real Ray denoiser workers: two workers join a gloo world, run a video
sequence-parallel, pause it to host memory, and resume it alone on the other worker; the result
equals an uninterrupted run on one worker."""

import dataclasses

import numpy as np
import pytest
import ray
import torch

from stepserve.actors.pool import WorkerPoolSpec, start_workers
from stepserve.engine.families import TEXT, load_family
from stepserve.engine.video_runner import PAUSED
from stepserve.runtime import start_local_ray

from ...tiny_video import RESUME_AFTER, TINY_WAN, UNEVEN, make_video_spec, video_embeds

ATOL = 2e-5  # as test_ulysses: a split sequence changes GEMM shapes (and so rounding) only


@pytest.fixture(scope="module")
def workers():
    started = not ray.is_initialized()
    start_local_ray(num_cpus=2, object_store_mb=128)
    # One torch thread each: the two workers share the machine's cores. No CPU reservation, so
    # they can be placed even in a Ray whose CPUs another fixture's app already holds.
    pool = WorkerPoolSpec(num_workers=2, num_cpus=0, device="cpu", torch_threads=1)
    handles = list(start_workers(pool, [TINY_WAN], "video-test").values())
    try:
        ray.get([w.ready.remote() for w in handles])
        addr, port = ray.get(handles[0].sp_rendezvous_address.remote())
        ray.get([w.join_sp_world.remote(addr, port, rank, len(handles)) for rank, w in enumerate(handles)])
        yield handles
    finally:
        # Bounded: a worker stuck in a collective would never answer; killing it is enough then.
        ray.wait([w.leave_sp_world.remote() for w in handles], num_returns=len(handles), timeout=30)
        for w in handles:
            ray.kill(w)
        if started:
            ray.shutdown()


def _finish(worker, job: str, rank: int) -> tuple[torch.Tensor, np.ndarray]:
    """Steps `job` alone to the end, then (final latents, decoded frames)."""
    while not ray.get(worker.video_step.remote(job, (rank,))).done:
        pass
    state = worker.video_export.remote(job)
    latents = ray.get(state)["latents"]
    ray.get(worker.video_import.remote(state))
    return latents, ray.get(worker.video_decode.remote(job))


def test_sp2_then_paused_and_resumed_alone_elsewhere_equals_uninterrupted(workers):
    w0, w1 = workers
    spec = make_video_spec(**UNEVEN)  # 27 tokens (uneven shards), CFG, 4 steps
    embeds = ray.put(video_embeds(load_family(TINY_WAN, {TEXT}, "cpu"), spec))

    reference = dataclasses.replace(spec, request_id="reference")
    ray.get(w0.video_start.remote(reference, embeds))
    ref_latents, ref_frames = _finish(w0, "reference", 0)

    # Both members start their own copy and step together over ranks (0, 1).
    ray.get([w.video_start.remote(spec, embeds) for w in workers])
    for _ in range(RESUME_AFTER):
        progress = ray.get([w.video_step.remote(spec.request_id, (1, 0)) for w in workers])
    assert {(p.steps_done, p.steps_total) for p in progress} == {(RESUME_AFTER, 4)}

    # Pause: w0 exports (the state goes to w1 as an object ref, never through the driver), w1
    # drops its own copy; then resume at SP=1 on w1.
    state = w0.video_export.remote(spec.request_id)
    ray.get(w1.video_drop.remote(spec.request_id))
    resumed = ray.get(w1.video_import.remote(state))
    assert (resumed.job_id, resumed.steps_done) == (spec.request_id, RESUME_AFTER)
    paused = ray.get(state)[PAUSED]
    print(f"\npause (export to host) {paused.duration_s * 1e3:.2f} ms, resume (import) {resumed.duration_s * 1e3:.2f} ms")
    assert paused.steps_done == RESUME_AFTER and paused.duration_s < 1 and resumed.duration_s < 1

    latents, frames = _finish(w1, spec.request_id, 1)
    torch.testing.assert_close(latents, ref_latents, atol=ATOL, rtol=0)
    assert frames.shape == (9, 48, 48, 3) and frames.dtype == np.uint8
    assert np.abs(frames.astype(int) - ref_frames.astype(int)).max() <= 1
    with pytest.raises(ray.exceptions.RayTaskError, match="not resident"):  # w0 let it go at export
        ray.get(w0.video_step.remote(spec.request_id, (0,)))
