"""The Wan video family and its per-video sampler: equal to the plain WanPipeline, and a video
paused, exported and resumed elsewhere equals an uninterrupted one."""

import os
import pickle
import time

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from stepserve.engine.families import ALL_PARTS, DENOISER, FAMILIES, VAE, ModelSource, load_family
from stepserve.engine.families.wan import FULL, WanFamily
from stepserve.engine.sampler import Sampler
from stepserve.engine.tokenizer import character_t5_tokenizer

from tests.tiny_video import TINY_WAN, make_video_spec, run_video, solo_pipeline_video, video_conditioning

LATENT_ATOL = 1e-5  # fp32 CPU; our one CFG forward of two rows vs the pipeline's two forwards
FRAME_ATOL = 2e-5


@pytest.fixture(scope="module")
def wan():
    return load_family(TINY_WAN, ALL_PARTS, "cpu")


def test_registered_and_shapes(wan):
    assert FAMILIES["wan"] is WanFamily
    spec = make_video_spec(frames=9)
    sampler = Sampler(spec, wan, video_conditioning(wan, spec))
    assert sampler.latents.shape == (1, 16, 3, 8, 8) and sampler.latents.dtype == torch.float32
    assert wan.encode_text(["a", "b c"])["context"].shape == (2, wan.max_sequence_length, 32)
    video = wan.decode(run_video(wan, spec, video_conditioning(wan, spec), steps=None).latents)
    assert video.shape == (1, 9, 64, 64, 3) and 0.0 <= video.min() and video.max() <= 1.0


def test_pipeline_rounding_rules(wan):
    assert wan.video_shape(64, 48, 6) == (64, 48, 5)  # frames become 4k+1, as WanPipeline does
    assert wan.video_shape(64, 64, 1) == (64, 64, 1)
    with pytest.raises(ValueError, match="divisible by 16"):
        wan.video_shape(60, 64, 5)


def test_tiny_step_is_fast(wan):
    spec = make_video_spec(frames=9, guidance=5.0)
    sampler = Sampler(spec, wan, video_conditioning(wan, spec))
    sampler.step(wan)  # warm-up
    start = time.perf_counter()
    sampler.step(wan)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "params",
    [dict(guidance=5.0, negative="blurry, static", steps=5, seed=42), dict(guidance=1.0, steps=3, seed=7, width=48)],
    ids=["cfg", "no-cfg"],
)
def test_sampler_equals_pipeline(wan, params):
    spec = make_video_spec(**params)
    latents = run_video(wan, spec, video_conditioning(wan, spec)).latents
    torch.testing.assert_close(latents, solo_pipeline_video(wan, spec, "latent"), atol=LATENT_ATOL, rtol=0)
    np.testing.assert_allclose(wan.decode(latents), solo_pipeline_video(wan, spec), atol=FRAME_ATOL)


def test_different_seeds_differ(wan):
    """Guard against tests that cannot fail."""
    a, b = (make_video_spec(seed=s, steps=2) for s in (1, 2))
    assert not torch.allclose(run_video(wan, a, video_conditioning(wan, a)).latents,
                              run_video(wan, b, video_conditioning(wan, b)).latents)


def test_pause_export_resume_equals_uninterrupted(wan):
    spec = make_video_spec(steps=6, seed=3, guidance=5.0, frames=9, negative="dark")
    cond = video_conditioning(wan, spec)
    uninterrupted = run_video(wan, spec, cond).latents

    paused = run_video(wan, spec, cond, steps=3)
    state = paused.state()
    history = state["scheduler"]["attrs"]["model_outputs"]
    assert state["step_index"] == 3 and any(h is not None for h in history)  # UniPC history travels
    tensors = [state["latents"], state["cond"]["context"], *[h for h in history if h is not None]]
    assert all(t.device.type == "cpu" for t in tensors)
    blob = pickle.dumps(state)

    # Another worker: a fresh family object holding only the transformer.
    other = load_family(TINY_WAN, {DENOISER}, "cpu")
    for _ in range(2):  # the same state resumes the same way every time
        resumed = Sampler.from_state(pickle.loads(blob), other)
        assert resumed.step_index == 3 and resumed.steps_total == 6
        while not resumed.done:
            resumed.step(other)
        assert torch.equal(resumed.latents, uninterrupted)
    # The paused sampler itself is unaffected by the export and can go on, too.
    while not paused.done:
        paused.step(wan)
    assert torch.equal(paused.latents, uninterrupted)


def test_stepping_a_finished_video_is_an_error(wan):
    spec = make_video_spec(steps=1)
    sampler = run_video(wan, spec, video_conditioning(wan, spec))
    with pytest.raises(RuntimeError, match="steps are done"):
        sampler.model_input()


def test_preset_parts_are_seeded_independently(wan):
    only = load_family(TINY_WAN, {DENOISER}, "cpu")
    for a, b in zip(only.transformer.parameters(), wan.transformer.parameters()):
        assert torch.equal(a, b)
    other = load_family(ModelSource(name="x", family="wan", preset="tiny", seed=1), {DENOISER}, "cpu")
    assert not torch.equal(next(other.transformer.parameters()), next(wan.transformer.parameters()))


def test_local_safetensors_folder_round_trip(wan, tmp_path):
    wan.pipe.save_pretrained(tmp_path, safe_serialization=True)
    assert any(f.endswith(".safetensors") for _, _, fs in os.walk(tmp_path) for f in fs)
    loaded = load_family(ModelSource(name="local", family="wan", path=str(tmp_path)), ALL_PARTS, "cpu")
    loaded.max_sequence_length = wan.max_sequence_length  # folders default to the pipeline's 512
    spec = make_video_spec(steps=2, seed=5)
    np.testing.assert_allclose(solo_pipeline_video(loaded, spec), solo_pipeline_video(wan, spec), atol=1e-6)


def test_folder_without_safetensors_is_refused(wan, tmp_path):
    wan.pipe.save_pretrained(tmp_path, safe_serialization=False)  # .bin for the diffusers parts
    source = ModelSource(name="bin", family="wan", path=str(tmp_path))
    for parts in ({DENOISER}, {VAE}, ALL_PARTS):
        with pytest.raises(OSError, match="safetensors"):
            load_family(source, parts, "cpu")


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_family(ModelSource(name="nope", family="wan", path=str(tmp_path / "nope")), ALL_PARTS, "cpu")


def test_character_t5_tokenizer_is_offline_and_deterministic():
    tok = character_t5_tokenizer(16)
    ids = tok("a red fox", padding="max_length", max_length=16, return_tensors="pt")
    assert ids.input_ids.shape == (1, 16)
    row = ids.input_ids[0].tolist()
    n = int(ids.attention_mask.sum())
    assert row[n - 1] == tok.eos_token_id == 1 and row[n:] == [tok.pad_token_id] * (16 - n) and tok.pad_token_id == 0
    assert 2 not in row[: n - 1]  # no <unk> for ASCII
    assert tok("a red fox").input_ids == character_t5_tokenizer(16)("a red fox").input_ids


def test_full_preset_has_wan_1_3b_sizes():
    """Sizes only, on the meta device: the full preset is for GPU speed runs."""
    with torch.device("meta"):
        model = WanTransformer3DModel(**FULL["transformer"])
    params = sum(p.numel() for p in model.parameters())
    assert 1.2e9 < params < 1.6e9, params
    assert model.config.num_attention_heads * model.config.attention_head_dim == 1536
