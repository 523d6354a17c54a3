"""Golden tests: an edit served step by step, alone or inside a mixed continuous batch, equals the
diffusers inpaint pipeline run alone on the same components with the same seed."""

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import StableDiffusion3InpaintPipeline, StableDiffusionInpaintPipeline

from stepserve.engine.inpaint import edit_pixels, mask_ratio
from stepserve.engine.sampler import Conditioning, RequestInputs, Sampler
from stepserve.engine.step_runner import Admission
from stepserve.engine.text_encoding import encode_pair
from stepserve.policies.types import RequestKind, RequestSpec

from tests.tiny import control_image, make_spec, run_continuous_batch

INPAINT = {"sd15": StableDiffusionInpaintPipeline, "sd3": StableDiffusion3InpaintPipeline}


def rect_mask(size: int, box: tuple[int, int, int, int]) -> PIL.Image.Image:
    """White (repaint) inside `box` (left, top, right, bottom), black elsewhere."""
    pixels = np.zeros((size, size), dtype=np.uint8)
    left, top, right, bottom = box
    pixels[top:bottom, left:right] = 255
    return PIL.Image.fromarray(pixels, mode="L")


def edit_spec(family, rid: str, strength: float = 1.0, steps: int = 6, seed: int = 0, size: int = 64,
              box=(16, 8, 48, 40), prompt: str = "a red fox") -> tuple[RequestSpec, RequestInputs]:
    base = make_spec(rid, steps=steps, seed=seed, size=size, prompt=prompt, model=family.source.name)
    image, mask = edit_pixels(control_image(seed + 100, size), rect_mask(size, box), size, size)
    spec = RequestSpec(**{**base.__dict__, "kind": RequestKind.EDIT, "strength": strength,
                          "skip_steps": type(family).skipped_steps(steps, strength),
                          "mask_ratio": mask_ratio(mask, family.vae_scale_factor)})
    return spec, RequestInputs(image=image, mask=mask)


def edit_admission(family, spec: RequestSpec, inputs: RequestInputs) -> Admission:
    prompt, negative = encode_pair(family, spec)
    return Admission(spec, conditioning=Conditioning.from_numpy(prompt, negative, inputs))


def pipeline_latents(family, spec: RequestSpec, inputs: RequestInputs) -> np.ndarray:
    """The inpaint pipeline alone on the family's own components (latents, before the VAE)."""
    components = {k: v for k, v in family.pipe.components.items()
                  if k in INPAINT[family.source.family]._get_signature_keys(INPAINT[family.source.family])[0]}
    components["scheduler"] = family.make_scheduler()
    pipe = INPAINT[family.source.family](**components)
    pipe.set_progress_bar_config(disable=True)
    extra = {"max_sequence_length": 256} if family.source.family == "sd3" else {}
    with torch.inference_mode():
        latents = pipe(spec.prompt, negative_prompt=spec.negative_prompt or None, image=PIL.Image.fromarray(inputs.image),
                       mask_image=PIL.Image.fromarray(inputs.mask, mode="L"), height=spec.height, width=spec.width,
                       strength=spec.strength, num_inference_steps=spec.num_inference_steps,
                       guidance_scale=spec.guidance_scale, generator=torch.Generator("cpu").manual_seed(spec.seed),
                       output_type="latent", **extra).images
    return latents.float().cpu().numpy()


@pytest.fixture(params=["tiny_family", "tiny_sd3"])
def edit_family(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_an_edit_alone_equals_the_inpaint_pipeline(edit_family, strength):
    spec, inputs = edit_spec(edit_family, "e", strength=strength)
    # 6 x 0.6 = 3.6: SD's pipeline runs int(3.6) = 3 steps, SD3's keeps the fraction (4).
    assert spec.steps_to_run == {1.0: 6, 0.6: 3 if edit_family.source.family == "sd15" else 4}[strength]
    got = run_continuous_batch(edit_family, {0: [spec]}, admit=lambda s: edit_admission(edit_family, s, inputs))
    np.testing.assert_allclose(got["e"], pipeline_latents(edit_family, spec, inputs), atol=1e-5, rtol=1e-4)


def test_edits_inside_a_mixed_batch_equal_the_pipeline_alone(edit_family):
    """Two edits (other masks, strengths, seeds) and a generation share every forward they overlap in."""
    fam = edit_family
    first, first_in = edit_spec(fam, "e1", strength=1.0, seed=1)
    second, second_in = edit_spec(fam, "e2", strength=0.5, seed=2, box=(0, 0, 32, 64), prompt="a blue bird")
    inputs = {"e1": first_in, "e2": second_in}
    plain = make_spec("g", steps=5, seed=3, model=fam.source.name)

    def admit(spec):
        return edit_admission(fam, spec, inputs[spec.request_id]) if spec.is_edit else \
            Admission(spec, conditioning=Conditioning.from_numpy(*encode_pair(fam, spec)))

    got = run_continuous_batch(fam, {0: [first, plain], 2: [second]}, admit=admit)
    for spec in (first, second):
        np.testing.assert_allclose(got[spec.request_id], pipeline_latents(fam, spec, inputs[spec.request_id]),
                                   atol=1e-5, rtol=1e-4)


def test_an_edit_paused_and_resumed_equals_one_run_through(tiny_sd3):
    spec, inputs = edit_spec(tiny_sd3, "e", strength=0.8)
    conditioning = edit_admission(tiny_sd3, spec, inputs).conditioning
    whole = Sampler(spec, tiny_sd3, conditioning)
    cut = Sampler(spec, tiny_sd3, conditioning)
    for _ in range(2):
        whole.step(tiny_sd3)
        cut.step(tiny_sd3)
    cut = Sampler.from_state(cut.state(), tiny_sd3)
    while not whole.done:
        whole.step(tiny_sd3)
        cut.step(tiny_sd3)
    assert cut.done
    torch.testing.assert_close(cut.latents, whole.latents, rtol=0, atol=0)


def test_an_edit_without_its_image_or_on_a_model_that_cannot_edit_is_refused(tiny_family, tiny_flux):
    spec, inputs = edit_spec(tiny_family, "e")
    with pytest.raises(ValueError, match="needs its image and mask"):
        Sampler(spec, tiny_family, Conditioning.from_numpy(*encode_pair(tiny_family, spec)))
    flux_spec, _ = edit_spec(tiny_flux, "f")
    with pytest.raises(ValueError, match="does not edit images"):
        Sampler(flux_spec, tiny_flux, edit_admission(tiny_flux, flux_spec, inputs).conditioning)
