"""What is particular to the SD3 family: its three text encoders, a scheduler that shifts by image
size, and the published SD3.5-Medium sizes. (The mixed-batch, move and loading tests run for
every image family in test_golden.py and test_loading.py.)"""

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from stepserve.engine.families.sd3 import FULL, MAX_SEQUENCE_LENGTH
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, solo_pipeline_image


def test_a_batch_of_texts_encodes_as_each_alone(tiny_sd3):
    texts = ["a red fox", "", "a much longer prompt about a lighthouse on a cliff at dusk"]
    batch = tiny_sd3.encode_text(texts)
    assert batch["context"].shape == (3, 77 + MAX_SEQUENCE_LENGTH, 64)  # CLIP tokens, then T5's
    assert batch["pooled"].shape == (3, 64)  # both CLIP projections
    for i, text in enumerate(texts):
        alone = tiny_sd3.encode_text([text])
        for name in ("context", "pooled"):
            torch.testing.assert_close(batch[name][i : i + 1], alone[name], atol=1e-6, rtol=0)


def test_a_size_shifted_schedule_is_per_request(tiny_sd3):
    """With a dynamically shifting scheduler (a folder may configure one), each request's
    timesteps shift by its own image size: two sizes stepped in one plan equal their solo runs."""
    family = tiny_sd3
    original = family.pipe.scheduler
    family.pipe.scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256, base_shift=0.5,
        max_shift=1.16,
    )
    try:
        specs = [make_spec("small", steps=4, seed=1, size=32, model="tiny-sd3"),
                 make_spec("large", steps=4, seed=2, size=64, model="tiny-sd3")]
        runner = StepRunner("w0", {"tiny-sd3": family})
        admissions = {s.request_id: admission_for(family, s) for s in specs}
        groups = tuple(StepGroup((s.request_id,)) for s in specs)
        _, latents = runner.execute(WorkerPlan("w0", admit=tuple(admissions), groups=groups, steps=4,
                                               finish=tuple(admissions)), admissions)
        timesteps = [runner_timesteps(family, s) for s in specs]
        assert not torch.equal(timesteps[0], timesteps[1])  # the shift did depend on size
        for spec, lat in zip(specs, latents):
            image = family.decode(torch.from_numpy(lat))[0]
            np.testing.assert_allclose(image, solo_pipeline_image(family, spec), atol=2e-5, err_msg=spec.request_id)
    finally:
        family.pipe.scheduler = original


def runner_timesteps(family, spec) -> torch.Tensor:
    scheduler = family.make_scheduler()
    family.prepare_scheduler(scheduler, spec)
    return scheduler.timesteps


def test_full_preset_has_sd35_medium_sizes():
    t = FULL["transformer"]
    inner = t["num_attention_heads"] * t["attention_head_dim"]
    assert (t["num_layers"], inner, t["caption_projection_dim"], t["pos_embed_max_size"]) == (24, 1536, 1536, 384)
    assert t["pooled_projection_dim"] == FULL["text"]["projection_dim"] + FULL["text_2"]["projection_dim"]
    assert t["joint_attention_dim"] == FULL["text_3"]["d_model"] == 4096
    assert FULL["vae"]["latent_channels"] == t["in_channels"] == 16

