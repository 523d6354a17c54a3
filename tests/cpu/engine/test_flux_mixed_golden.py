"""Golden: Flux requests of four sizes (64x128 and 128x64 among them), with their own guidance,
joining a worker that packs resolutions (`StepRunner(pack_resolutions=True)`) at different steps,
one group each: the worker runs one packed forward a step (`FluxFamily.denoise_mixed`), and each
request's image equals the plain `FluxPipeline` run alone with the same seed."""

from dataclasses import replace

import numpy as np
import torch

from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, solo_pipeline_image


def test_sizes_joining_at_different_steps_step_in_one_forward_and_each_equals_its_pipeline(tiny_flux, monkeypatch):
    model = tiny_flux.source.name
    small = make_spec("small", steps=3, seed=1, size=64, guidance=3.5, model=model)
    wide = replace(make_spec("wide", steps=4, seed=2, size=64, model=model, prompt="a lighthouse at dusk"), width=128)
    tall = replace(make_spec("tall", steps=3, seed=3, size=64, guidance=5.0, model=model), height=128)
    mid = make_spec("mid", steps=2, seed=4, size=96, guidance=2.0, model=model)
    arrivals = {0: [small, wide], 1: [tall], 2: [mid]}  # all four resident at round 2; the last leave at round 3

    forwards = {"plain": 0, "packed": 0}
    for name, key in (("denoise", "plain"), ("denoise_mixed", "packed")):
        def counted(*args, _run=getattr(tiny_flux, name), _key=key, **kwargs):
            forwards[_key] += 1
            return _run(*args, **kwargs)

        monkeypatch.setattr(tiny_flux, name, counted)

    runner = StepRunner("w0", {model: tiny_flux}, modes=ModeSettings(pack_resolutions=True))
    left, finished = {}, {}
    for rnd in range(4):
        admissions = {s.request_id: admission_for(tiny_flux, s) for s in arrivals.get(rnd, [])}
        left.update({rid: a.spec.num_inference_steps for rid, a in admissions.items()})
        finish = tuple(rid for rid in left if left[rid] == 1)
        plan = WorkerPlan("w0", admit=tuple(admissions), groups=tuple(StepGroup((rid,)) for rid in left),
                          finish=finish, plan_id=rnd)
        report, payloads = runner.execute(plan, admissions)
        assert not report.failed, report.failed
        finished.update(zip(finish, payloads))
        left = {rid: n - 1 for rid, n in left.items() if rid not in finish}
    assert not left and forwards == {"plain": 0, "packed": 4}  # one forward a step, however many sizes

    for spec in (small, wide, tall, mid):
        latents = finished[spec.request_id]
        assert latents.shape[2:] == (spec.height // 8, spec.width // 8)
        image = tiny_flux.decode(torch.from_numpy(latents))[0]
        np.testing.assert_allclose(image, solo_pipeline_image(tiny_flux, spec), atol=2e-5, err_msg=spec.request_id)
