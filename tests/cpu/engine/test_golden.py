"""A request served inside a mixed continuous batch equals the solo diffusers pipeline."""

import functools
import pickle

import diffusers
import numpy as np
import pytest
import torch

from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, run_continuous_batch, solo_pipeline_image

ATOL = 2e-5  # fp32 CPU; batching changes GEMM blocking only


def _image(family, latents: np.ndarray) -> np.ndarray:
    return family.decode(torch.from_numpy(latents))[0]


def test_mixed_batch_matches_solo_pipeline(image_family):
    family = image_family
    spec = functools.partial(make_spec, model=family.source.name)
    target = spec("target", steps=8, seed=42, guidance=7.5, prompt="a lighthouse at dusk", negative="blurry")
    others = {
        0: [spec("a", steps=3, seed=1, guidance=5.0)],  # an empty negative prompt (SDXL: zeros)
        2: [target, spec("b", steps=12, seed=2, guidance=1.0, prompt="no cfg here")],
        4: [spec("c", steps=4, seed=3, guidance=9.0, prompt="late joiner")],
    }
    latents = run_continuous_batch(family, others)
    assert set(latents) == {"a", "b", "c", "target"}
    for s in [target, others[0][0], others[2][1], others[4][0]]:
        image = _image(family, latents[s.request_id])
        expected = solo_pipeline_image(family, s)
        np.testing.assert_allclose(image, expected, atol=ATOL, err_msg=s.request_id)


def test_batched_forward_differs_by_request(tiny_family):
    """Guard against a test that cannot fail: different seeds must give different images."""
    latents = run_continuous_batch(tiny_family, {0: [make_spec("x", seed=1), make_spec("y", seed=2)]})
    assert not np.allclose(latents["x"], latents["y"])


@pytest.mark.parametrize("size", [(64, 128), (128, 64)])
def test_non_square_sizes(tiny_family, size):
    h, w = size
    spec = make_spec("r", steps=3, seed=7)
    spec = type(spec)(**{**spec.__dict__, "height": h, "width": w})
    image = _image(tiny_family, run_continuous_batch(tiny_family, {0: [spec]})["r"])
    assert image.shape == (h, w, 3)
    np.testing.assert_allclose(image, solo_pipeline_image(tiny_family, spec), atol=ATOL)


# Schedulers a model may be served with instead of its own, by the schedule it was trained on:
# multistep history, and stochastic steps where the pipeline seeds them (SD's; the flow-matching
# pipelines pass `step` no generator), must survive a move too.
FLOW = dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
ALTERNATIVE_SCHEDULERS = {
    "noise": [("DPMSolverMultistepScheduler", {}), ("EulerAncestralDiscreteScheduler", {})],
    "flow": [("DPMSolverMultistepScheduler", FLOW), ("UniPCMultistepScheduler", FLOW)],
}


@pytest.mark.parametrize("alternative", [None, 0, 1])
def test_an_image_moved_between_workers_mid_way_equals_the_solo_pipeline(image_family, alternative):
    """An image exported by one worker (latents, scheduler history, generator position, pickled
    as Ray would) and admitted from that state by another ends as the solo pipeline's."""
    family = image_family
    original = family.pipe.scheduler
    if alternative is not None:
        schedule = "flow" if isinstance(original, diffusers.FlowMatchEulerDiscreteScheduler) else "noise"
        name, overrides = ALTERNATIVE_SCHEDULERS[schedule][alternative]
        family.pipe.scheduler = getattr(diffusers, name).from_config(original.config, **overrides)
    try:
        spec = make_spec("moved", steps=6, seed=7, guidance=7.5, negative="blurry", model=family.source.name)
        models = {family.source.name: family}
        first, second = StepRunner("w0", models), StepRunner("w1", models)
        step = (StepGroup(("moved",)),)
        first.execute(WorkerPlan("w0", admit=("moved",), groups=step), {"moved": admission_for(family, spec)})
        first.execute(WorkerPlan("w0", groups=step), {})
        _, (state,) = first.execute(WorkerPlan("w0", groups=step, export=("moved",)), {})
        assert first.resident == () and state["step_index"] == 3
        resume = {"moved": Admission(spec, state=pickle.loads(pickle.dumps(state)))}
        report, _ = second.execute(WorkerPlan("w1", admit=("moved",), groups=step), resume)
        assert [(p.steps_done, p.steps_total) for p in report.progress] == [(4, 6)]
        second.execute(WorkerPlan("w1", groups=step), {})
        _, (latents,) = second.execute(WorkerPlan("w1", groups=step, finish=("moved",)), {})
        assert second.resident == ()
        np.testing.assert_allclose(_image(family, latents), solo_pipeline_image(family, spec), atol=ATOL)
    finally:
        family.pipe.scheduler = original
