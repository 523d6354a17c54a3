"""A request served inside a mixed continuous batch equals the solo diffusers pipeline."""

import numpy as np
import pytest

from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import WorkerPlan

from ...tiny import conditioning_for, make_spec, solo_pipeline_image

ATOL = 2e-5  # fp32 CPU; batching changes GEMM blocking only


def _run(family, arrivals: dict[int, list], rounds: int = 100):
    """Drive a StepRunner like continuous batching does: everyone resident steps each round,
    newcomers join at step boundaries, finished requests leave."""
    runner = StepRunner("w0", {"tiny-sd": family})
    done = {}
    for rnd in range(rounds):
        new = arrivals.get(rnd, [])
        admissions = {s.request_id: (s, conditioning_for(family, s)) for s in new}
        stepping = runner.resident + tuple(admissions)
        if not stepping:
            if rnd > max(arrivals):
                break
            continue
        plan = WorkerPlan("w0", admit=tuple(admissions), groups=(stepping,))
        report, finished = runner.execute(plan, admissions)
        assert not report.failed, report.failed
        done.update(finished)
    return done


def test_mixed_batch_matches_solo_pipeline(tiny_family):
    target = make_spec("target", steps=8, seed=42, guidance=7.5, prompt="a lighthouse at dusk", negative="blurry")
    others = {
        0: [make_spec("a", steps=3, seed=1, guidance=5.0)],
        2: [target, make_spec("b", steps=12, seed=2, guidance=1.0, prompt="no cfg here")],
        4: [make_spec("c", steps=4, seed=3, guidance=9.0, prompt="late joiner")],
    }
    latents = _run(tiny_family, others)
    assert set(latents) == {"a", "b", "c", "target"}
    for spec in [target, others[0][0], others[2][1], others[4][0]]:
        image = tiny_family.decode(latents[spec.request_id])[0]
        expected = solo_pipeline_image(tiny_family, spec)
        np.testing.assert_allclose(image, expected, atol=ATOL, err_msg=spec.request_id)


def test_batched_forward_differs_by_request(tiny_family):
    """Guard against a test that cannot fail: different seeds must give different images."""
    latents = _run(tiny_family, {0: [make_spec("x", seed=1), make_spec("y", seed=2)]})
    assert not np.allclose(latents["x"].numpy(), latents["y"].numpy())


@pytest.mark.parametrize("size", [(64, 128), (128, 64)])
def test_non_square_sizes(tiny_family, size):
    h, w = size
    spec = make_spec("r", steps=3, seed=7)
    spec = type(spec)(**{**spec.__dict__, "height": h, "width": w})
    image = tiny_family.decode(_run(tiny_family, {0: [spec]})["r"])[0]
    assert image.shape == (h, w, 3)
    np.testing.assert_allclose(image, solo_pipeline_image(tiny_family, spec), atol=ATOL)


@pytest.mark.parametrize("scheduler", [None, "DPMSolverMultistepScheduler", "EulerAncestralDiscreteScheduler"])
def test_an_image_moved_between_workers_mid_way_equals_the_solo_pipeline(tiny_family, scheduler):
    """The co-serving router moves a resident image to the worker its batch runs on: the state
    (latents, scheduler history, generator position) crosses through host memory, pickled as
    Ray would, and the result is the solo pipeline's."""
    import pickle

    import diffusers

    family = tiny_family
    original = family.pipe.scheduler
    if scheduler is not None:  # multistep history and stochastic steps must survive the move too
        family.pipe.scheduler = getattr(diffusers, scheduler).from_config(original.config)
    try:
        spec = make_spec("moved", steps=6, seed=7, guidance=7.5, negative="blurry")
        first, second = StepRunner("w0", {"tiny-sd": family}), StepRunner("w1", {"tiny-sd": family})
        admissions = {"moved": (spec, conditioning_for(family, spec))}
        for k in range(3):
            first.execute(WorkerPlan("w0", admit=("moved",) if k == 0 else (), groups=(("moved",),)), admissions)
        second.import_state(pickle.loads(pickle.dumps(first.export("moved"))))
        assert first.resident == () and second.resident == ("moved",)
        finished = {}
        while not finished:
            _, finished = second.execute(WorkerPlan("w1", groups=(("moved",),)), {})
        image = family.decode(finished["moved"])[0]
        np.testing.assert_allclose(image, solo_pipeline_image(family, spec), atol=ATOL)
    finally:
        family.pipe.scheduler = original
