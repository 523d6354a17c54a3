"""The Flux family: unpacked latents step exactly as the pipeline's packed ones, guidance is a
model input of one row per request, and sizes whose tokens count alike (tall and wide) share a
forward as two pieces, each with its own position ids."""

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file as load_safetensors

from stepserve.engine.families import ALL_PARTS, DENOISER, FAMILIES, TEXT, VAE, ModelSource, load_family
from stepserve.engine.families.flux import FULL, TINY, FluxFamily, build_preset_components
from stepserve.engine.families.presets import t5_encoder
from stepserve.engine.sampler import Sampler
from stepserve.engine.step_runner import StepRunner
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.policies.types import RequestKind, StepGroup, WorkerPlan

from tests.tiny import TINY_FLUX, admission_for, make_spec, solo_pipeline_image

ATOL = 2e-5  # fp32 CPU, as the golden tests
spec = functools.partial(make_spec, model=TINY_FLUX.name)


def _sample(family, request) -> torch.Tensor:
    """A request's final latents, stepped alone by its sampler."""
    sampler = Sampler(request, family, encode_conditioning(family, request))
    while not sampler.done:
        sampler.step(family)
    return sampler.latents


def _pipeline_latents(family, request) -> torch.Tensor:
    """The plain pipeline's final latents (packed, as its loop keeps them), unpacked."""
    with torch.inference_mode():
        packed = family.pipe(
            request.prompt, height=request.height, width=request.width,
            num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent",
            max_sequence_length=family.max_sequence_length,
        ).images
    return FluxPipeline._unpack_latents(packed, request.height, request.width, family.vae_scale_factor)


@pytest.fixture(scope="module")
def schnell_like():
    """Tiny Flux without the guidance embedding, on schnell's published (unshifted) scheduler."""
    components = build_preset_components("tiny", 0, ALL_PARTS, torch.device("cpu"), torch.float32)
    torch.manual_seed(1)
    components[DENOISER] = FluxTransformer2DModel(**{**TINY["transformer"], "guidance_embeds": False})
    components["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    return FluxFamily(TINY_FLUX, components, torch.device("cpu"))


def test_registered_and_declared(tiny_flux):
    assert FAMILIES["flux"] is FluxFamily
    assert (FluxFamily.kind, FluxFamily.size_multiple, FluxFamily.frame_step) == (RequestKind.T2I, 16, 1)
    assert not FluxFamily.classifier_free_guidance and not FluxFamily.decode_on_worker
    assert not FluxFamily.sequence_parallel
    assert tiny_flux.vae_scale_factor * 2 == FluxFamily.size_multiple  # VAE 8x times the 2x2 packing
    assert tiny_flux.latent_channels == 16 == tiny_flux.denoiser.config.in_channels // 4
    with pytest.raises(ValueError, match="cannot run sequence-parallel"):
        tiny_flux.denoise(torch.zeros(1, 16, 8, 8), torch.tensor([1000.0]), {}, sp_group=object())


def test_unpacked_stepping_equals_the_pipelines_packed_stepping(tiny_flux):
    # The scheduler alone: its step is elementwise, so packing commutes with it bit for bit.
    request = spec("r", steps=5, seed=3, size=64)
    packed_scheduler, unpacked_scheduler = tiny_flux.make_scheduler(), tiny_flux.make_scheduler()
    for scheduler in (packed_scheduler, unpacked_scheduler):
        tiny_flux.prepare_scheduler(scheduler, request)
    gen = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(1, 16, 8, 8, generator=gen)
    packed = FluxPipeline._pack_latents(latents, 1, 16, 8, 8)
    for t in unpacked_scheduler.timesteps:
        velocity = torch.randn(1, 16, 8, 8, generator=gen)
        latents = unpacked_scheduler.step(velocity, t, latents, return_dict=False)[0]
        packed = packed_scheduler.step(FluxPipeline._pack_latents(velocity, 1, 16, 8, 8), t, packed,
                                       return_dict=False)[0]
        assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 64, tiny_flux.vae_scale_factor), latents)
    # The whole request: the sampler's latents are the pipeline's, bit for bit.
    assert torch.equal(_sample(tiny_flux, request), _pipeline_latents(tiny_flux, request))


def test_sizes_that_pack_alike_share_a_forward_each_with_its_own_positions(tiny_flux):
    tall = replace(spec("tall", steps=3, seed=4), height=128, width=64)
    wide = replace(tall, request_id="wide", height=64, width=128)
    shapes = [tiny_flux.latent_shape(s.height, s.width) for s in (tall, wide)]
    assert shapes[0] != shapes[1] and shapes[0][2] * shapes[0][3] == shapes[1][2] * shapes[1][3]
    runner = StepRunner("w0", {TINY_FLUX.name: tiny_flux})
    both = {s.request_id: admission_for(tiny_flux, s) for s in (tall, wide)}
    # One group, one forward a step (`denoise_mixed`: a piece per latent shape), each the pipeline's image.
    plan = WorkerPlan("w0", admit=tuple(both), groups=(StepGroup(tuple(both)),), steps=3, finish=tuple(both))
    report, latents = runner.execute(plan, both)
    assert not report.failed
    for s, finished in zip((tall, wide), latents):
        image = tiny_flux.decode(torch.from_numpy(finished))[0]
        assert image.shape == (s.height, s.width, 3)
        np.testing.assert_allclose(image, solo_pipeline_image(tiny_flux, s), atol=ATOL, err_msg=s.request_id)


def test_guidance_reaches_the_model(tiny_flux):
    low, high = (spec("g", steps=3, seed=9, guidance=g) for g in (2.0, 6.0))
    assert not torch.allclose(_sample(tiny_flux, low), _sample(tiny_flux, high))


def test_a_model_without_guidance_embeds_ignores_the_scale(schnell_like):
    low, high = (spec("g", steps=3, seed=9, guidance=g) for g in (2.0, 6.0))
    latents = _sample(schnell_like, low)
    assert torch.equal(latents, _sample(schnell_like, high))
    assert torch.equal(latents, _pipeline_latents(schnell_like, low))


def test_a_request_adds_one_row_whatever_its_guidance(tiny_flux):
    request = spec("r", guidance=7.5, negative="blurry")  # as the ingress makes it for a Flux model
    assert not request.cfg and not request.uses_cfg and request.rows == 1
    conditioning = encode_conditioning(tiny_flux, request)
    assert conditioning.negative is None  # the negative prompt is not even encoded
    sample, timesteps, cond = Sampler(request, tiny_flux, conditioning).model_input()
    assert sample.shape == (1, 16, 8, 8) and timesteps.shape == (1,)
    assert {name: tuple(value.shape) for name, value in cond.items()} == {
        "context": (1, tiny_flux.max_sequence_length, 32), "pooled": (1, 32), "guidance": (1,)
    }
    assert cond["guidance"].dtype == torch.float32 and cond["guidance"].item() == 7.5
    # A spec that asks this model for CFG rows is refused, not run with a stray unconditional row.
    with pytest.raises(ValueError, match="guidance-distilled"):
        Sampler(replace(request, cfg=True), tiny_flux, conditioning)


def test_a_batch_of_texts_encodes_as_each_alone(tiny_flux):
    texts = ["a red fox", "", "a lighthouse at dusk"]
    batch = tiny_flux.encode_text(texts)
    assert batch["context"].shape == (3, tiny_flux.max_sequence_length, 32) and batch["pooled"].shape == (3, 32)
    for i, text in enumerate(texts):
        alone = tiny_flux.encode_text([text])
        for name in ("context", "pooled"):
            torch.testing.assert_close(batch[name][i : i + 1], alone[name], atol=1e-6, rtol=0)
    assert not torch.allclose(batch["pooled"][0], batch["pooled"][2])


def test_preset_parts_are_seeded_independently(tiny_flux):
    denoiser_only = load_family(TINY_FLUX, {DENOISER}, "cpu")
    for a, b in zip(denoiser_only.denoiser.parameters(), tiny_flux.denoiser.parameters(), strict=True):
        assert torch.equal(a, b)


def test_half_precision_keeps_t5_feed_forward_output_in_float32():
    family = load_family(replace(TINY_FLUX, dtype="bfloat16"), {TEXT}, "cpu")
    t5 = family.pipe.text_encoder_2
    kept = [p for name, p in t5.named_parameters() if "wo" in name.split(".")]
    assert kept and all(p.dtype == torch.float32 for p in kept)
    assert t5.shared.weight.dtype == torch.bfloat16 and family.pipe.text_encoder.dtype == torch.bfloat16
    assert family.encode_text(["a fox"])["context"].dtype == torch.bfloat16


def test_folder_without_safetensors_is_refused_part_by_part(tiny_flux, tmp_path):
    tiny_flux.pipe.save_pretrained(tmp_path, safe_serialization=False)  # .bin for the diffusers parts
    # transformers 5 saves safetensors whatever it is asked: turn T5's weights into a .bin by hand.
    t5 = tmp_path / "text_encoder_2"
    torch.save(load_safetensors(t5 / "model.safetensors"), t5 / "pytorch_model.bin")
    (t5 / "model.safetensors").unlink()
    source = ModelSource(name="bin", family="flux", path=str(tmp_path))
    for parts in ({TEXT}, {DENOISER}, {VAE}):
        with pytest.raises(OSError, match="safetensors"):
            load_family(source, parts, "cpu")


def test_full_preset_has_flux_1_dev_sizes():
    """Sizes only, on the meta device: the full preset is for GPU speed runs."""
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FULL["transformer"])
        t5 = t5_encoder(FULL["text_2"])
    config = transformer.config
    assert 11.5e9 < sum(p.numel() for p in transformer.parameters()) < 12.2e9  # FLUX.1-dev: 11.9B
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (19, 38)
    assert config.num_attention_heads * config.attention_head_dim == 3072 == 24 * 128
    assert sum(config.axes_dims_rope) == config.attention_head_dim and config.guidance_embeds
    assert config.joint_attention_dim == t5.config.d_model == 4096
    assert config.pooled_projection_dim == FULL["text"]["hidden_size"] == 768  # CLIP-L's pooled output
    assert 4.6e9 < sum(p.numel() for p in t5.parameters()) < 4.9e9  # T5-XXL's encoder: 4.76B
    assert FULL["vae"]["latent_channels"] * 4 == config.in_channels and len(FULL["vae"]["block_out_channels"]) == 4
