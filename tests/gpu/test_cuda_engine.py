"""The step engine on CUDA (run with `python -m pytest tests/gpu -m gpu` on a GPU machine)."""

import numpy as np
import pytest
import torch

from stepserve.engine.families import ALL_PARTS, DENOISER, ModelSource, load_family
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, solo_pipeline_image

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_family():
    assert torch.cuda.is_available(), "the gpu suite needs a CUDA device"
    return load_family(ModelSource(name="tiny-sd", family="sd15", preset="tiny"), ALL_PARTS, "cuda")


def test_mixed_batch_matches_solo_pipeline_on_cuda(cuda_family):
    runner = StepRunner("gpu0", {"tiny-sd": cuda_family})
    specs = [make_spec("a", steps=6, seed=1), make_spec("b", steps=9, seed=2, guidance=1.0)]
    admissions = {s.request_id: admission_for(cuda_family, s) for s in specs}
    left = {s.request_id: s.num_inference_steps for s in specs}
    done = {}
    while left:
        finish = tuple(rid for rid, n in left.items() if n == 1)
        plan = WorkerPlan("gpu0", admit=tuple(admissions), groups=(StepGroup(tuple(left)),), finish=finish)
        report, latents = runner.execute(plan, admissions)
        assert not report.failed and report.duration_s > 0, report
        admissions = {}
        left = {rid: n - 1 for rid, n in left.items() if rid not in finish}
        done.update(zip(finish, latents))
    assert runner.resident == ()
    for spec in specs:
        image = cuda_family.decode(torch.from_numpy(done[spec.request_id]))[0]
        np.testing.assert_allclose(image, solo_pipeline_image(cuda_family, spec), atol=1e-3)


def test_full_size_preset_steps_in_fp16():
    family = load_family(ModelSource(name="sd15", family="sd15", preset="full", dtype="float16"), {DENOISER}, "cuda")
    sample = torch.randn(4, 4, 64, 64, device="cuda", dtype=torch.float16)
    out = family.denoise(sample, torch.tensor([999, 999, 500, 500], device="cuda"),
                         {"context": torch.randn(4, 77, 768, device="cuda", dtype=torch.float16)})
    assert out.shape == sample.shape and torch.isfinite(out).all()
