"""Presets are deterministic; real folders load from local safetensors only."""

import os

import numpy as np
import pytest
import torch

from stepserve.engine.addons.controlnet import RemoteControlNets
from stepserve.engine.families import ALL_PARTS, DENOISER, FAMILIES, TEXT, VAE, ModelSource, load_family
from stepserve.engine.text_encoding import CachedTextEncoder

from tests.tiny import TINY, make_spec, solo_pipeline_image


def test_preset_parts_are_seeded_independently(tiny_family):
    unet_only = load_family(TINY, {DENOISER}, "cpu")
    for a, b in zip(unet_only.denoiser.parameters(), tiny_family.denoiser.parameters()):
        assert torch.equal(a, b)
    other_seed = load_family(ModelSource(name="x", family="sd15", preset="tiny", seed=1), {DENOISER}, "cpu")
    assert not torch.equal(next(other_seed.denoiser.parameters()), next(tiny_family.denoiser.parameters()))


def test_local_safetensors_folder_round_trip(image_family, tmp_path):
    image_family.pipe.save_pretrained(tmp_path, safe_serialization=True)
    assert any(f.endswith(".safetensors") for _, _, fs in os.walk(tmp_path) for f in fs)
    family = image_family.source.family
    loaded = load_family(ModelSource(name="local", family=family, path=str(tmp_path)), ALL_PARTS, "cpu")
    spec = make_spec("r", steps=3, seed=5)
    np.testing.assert_allclose(
        solo_pipeline_image(loaded, spec), solo_pipeline_image(image_family, spec), atol=1e-6
    )


def test_folder_without_safetensors_is_refused(image_family, tmp_path):
    image_family.pipe.save_pretrained(tmp_path, safe_serialization=False)
    with pytest.raises(Exception, match="safetensors|\\.safetensors"):
        load_family(ModelSource(name="bin", family=image_family.source.family, path=str(tmp_path)), ALL_PARTS, "cpu")


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_family(ModelSource(name="nope", family="sd15", path=str(tmp_path / "nope")), ALL_PARTS, "cpu")


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_an_unknown_preset_names_the_known_ones(family):
    with pytest.raises(ValueError, match=rf"unknown {family} preset 'huge'; known: \[.*'tiny'"):
        load_family(ModelSource(name="x", family=family, preset="huge"), ALL_PARTS, "cpu")


def test_model_source_needs_exactly_one_origin():
    with pytest.raises(ValueError, match="exactly one"):
        ModelSource(name="x", family="sd15")
    with pytest.raises(ValueError, match="exactly one"):
        ModelSource(name="x", family="sd15", preset="tiny", path="/tmp")


def test_text_cache_hits_and_equals_direct_encoding(tiny_family):
    enc = CachedTextEncoder({"tiny-sd": tiny_family}, cache_size=2)
    first = enc.encode("tiny-sd", ["a cat", ""])
    again = enc.encode("tiny-sd", ["", "a cat"])
    assert enc.misses == 2 and enc.hits == 2
    np.testing.assert_array_equal(first[0]["context"], again[1]["context"])
    direct = tiny_family.encode_text(["a cat"])["context"].numpy()
    assert first[0].keys() == {"context"}
    np.testing.assert_allclose(first[0]["context"], direct, atol=1e-6)
    enc.encode("tiny-sd", ["a dog"])  # evicts the least recently used: "" (used before "a cat")
    enc.encode("tiny-sd", ["a cat"])
    assert enc.misses == 3
    enc.encode("tiny-sd", [""])
    assert enc.misses == 4
    with pytest.raises(ValueError, match="no text encoder"):
        enc.encode("unknown", ["x"])


@pytest.mark.parametrize("name", ["sd15", "sdxl", "sd3", "flux"])
def test_full_presets_are_created_in_the_serving_dtype(name):
    """On the meta device (sizes and dtypes, no memory): a full preset is created in bfloat16, not
    built in float32 and cast (FLUX.1-dev with T5-XXL would not fit a GPU before the cast). What a
    class keeps in float32 (T5's feed-forward output) stays so, and SDXL's VAE, which decodes in
    float32, is built in it."""
    parts = FAMILIES[name].preset_components("full", 0, ALL_PARTS, torch.device("meta"), torch.bfloat16)
    modules = {key: value for key, value in parts.items() if isinstance(value, torch.nn.Module)}
    assert {DENOISER, TEXT, VAE} <= set(modules)
    for key, module in modules.items():
        keep = getattr(module, "_keep_in_fp32_modules", None) or ()
        for param_name, param in module.named_parameters():
            fp32 = (name == "sdxl" and key == VAE) or any(k in param_name.split(".") for k in keep)
            assert param.device.type == "meta"
            assert param.dtype == (torch.float32 if fp32 else torch.bfloat16), (key, param_name)
    assert torch.get_default_dtype() == torch.float32  # restored after each part


def test_a_family_is_built_with_where_its_controlnets_run():
    """The ControlNet service is given when the family is built (a worker changes no family after)."""
    service = object()
    family = load_family(ModelSource("tiny-sd", "sd15", preset="tiny"), {DENOISER}, "cpu",
                         RemoteControlNets(service))
    assert family.controlnet_service is service
    plain = load_family(ModelSource("tiny-sd", "sd15", preset="tiny"), {DENOISER}, "cpu")
    assert plain.controlnet_service is None
    with pytest.raises(ValueError, match="takes no ControlNets"):
        load_family(ModelSource("tiny-wan", "wan", preset="tiny"), {DENOISER}, "cpu", RemoteControlNets(service))
