"""What a family class declares it can serve agrees with what its loaded models really do."""

import re

import pytest
import torch

from stepserve.engine.families import DENOISER, FAMILIES, family_class, load_family
from stepserve.engine.families.sd15 import SD15Family
from stepserve.engine.families.sd3 import SD3Family
from stepserve.engine.families.sdxl import SDXLFamily
from stepserve.engine.families.wan import WanFamily
from stepserve.engine.sampler import Conditioning, Sampler
from stepserve.policies.types import RequestKind

from tests.tiny import make_spec
from tests.tiny_video import TINY_WAN, make_video_spec


@pytest.fixture(scope="module")
def wan():
    return load_family(TINY_WAN, {DENOISER}, "cpu")


def test_family_class_looks_up_the_registry():
    assert family_class("sd15") is SD15Family and family_class("wan") is WanFamily
    assert family_class("sdxl") is SDXLFamily and family_class("sd3") is SD3Family
    assert all(family_class(name) is cls for name, cls in FAMILIES.items())
    with pytest.raises(ValueError, match=re.escape(f"unknown model family 'nope'; known: {sorted(FAMILIES)}")):
        family_class("nope")


def test_declared_capabilities():
    declared = {name: (cls.kind, cls.size_multiple, cls.frame_step, cls.sequence_parallel, cls.decode_on_worker,
                       cls.classifier_free_guidance)
                for name, cls in FAMILIES.items()}
    assert declared == {
        "sd15": (RequestKind.T2I, 8, 1, False, False, True),
        "sdxl": (RequestKind.T2I, 8, 1, False, False, True),
        "sd3": (RequestKind.T2I, 16, 1, False, False, True),
        "flux": (RequestKind.T2I, 16, 1, False, False, False),
        "wan": (RequestKind.T2V, 16, 4, True, True, True),
        "wan-ti2v": (RequestKind.T2V, 32, 4, True, True, True),
    }


def test_sd15_capabilities_match_the_model(tiny_family):
    assert tiny_family.vae_scale_factor == SD15Family.size_multiple  # one latent pixel per multiple
    with pytest.raises(ValueError, match="divisible by 8"):  # the pipeline refuses other sides
        tiny_family.pipe.check_inputs("a fox", 60, 64, 1)
    sample = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="cannot run sequence-parallel"):
        tiny_family.denoise(sample, torch.tensor([999]), {"context": torch.zeros(1, 77, 32)}, sp_group=object())


def test_sdxl_capabilities_match_the_model(tiny_sdxl):
    assert tiny_sdxl.vae_scale_factor == SDXLFamily.size_multiple
    with pytest.raises(ValueError, match="divisible by 8"):
        tiny_sdxl.pipe.check_inputs("a fox", None, 60, 64, 1)
    with pytest.raises(ValueError, match="cannot run sequence-parallel"):
        tiny_sdxl.denoise(torch.zeros(1, 4, 8, 8), torch.tensor([999]), {}, sp_group=object())


def test_sd3_capabilities_match_the_model(tiny_sd3):
    patch = tiny_sd3.denoiser.config.patch_size
    assert tiny_sd3.vae_scale_factor * patch == SD3Family.size_multiple
    with pytest.raises(ValueError, match="divisible by 16"):
        tiny_sd3.pipe.check_inputs("a fox", None, None, 64 + 8, 64)
    with pytest.raises(ValueError, match="cannot run sequence-parallel"):
        tiny_sd3.denoise(torch.zeros(1, 16, 8, 8), torch.tensor([999.0]), {}, sp_group=object())


def test_wan_capabilities_match_the_model(wan):
    patch = wan.transformer.config.patch_size[1]
    assert wan.vae_scale_factor * patch == WanFamily.size_multiple
    assert wan.vae_scale_factor_temporal == WanFamily.frame_step
    assert [wan.video_shape(64, 64, 1 + k * WanFamily.frame_step)[2] for k in range(3)] == [1, 5, 9]
    assert wan.video_shape(64, 64, 7)[2] == 5  # not 1 + 4k: rounded down to it, as the pipeline does
    with pytest.raises(ValueError, match="divisible by 16"):
        wan.video_shape(64 + 8, 64, 5)


def test_a_sampler_refuses_a_request_of_another_kind(tiny_family, wan):
    text = Conditioning({"context": torch.zeros(1, 4, 32)}, {"context": torch.zeros(1, 4, 32)})
    with pytest.raises(ValueError, match="request i is t2i, but model 'tiny-wan' generates t2v"):
        Sampler(make_spec("i"), wan, text)
    with pytest.raises(ValueError, match="request v is t2v, but model 'tiny-sd' generates t2i"):
        Sampler(make_video_spec("v"), tiny_family, text)
