"""Random-weight add-ons of a preset model, deterministic by seed: a ControlNet of the real class
sized as the preset's UNet, and LoRAs over its attention projections. Their zero-initialised
layers (ControlNet's zero convolutions, LoRA's B) get small random values instead, so an add-on
changes the image and a test of it can fail.
"""

from __future__ import annotations

import os

import torch
from diffusers import ControlNetModel, StableDiffusionPipeline
from torch import nn

from stepserve.engine.addons.lora import LoraLayer, LoraWeights
from stepserve.engine.families import sd15, sdxl
from stepserve.engine.families.presets import preset_config

# The UNet configs of the families whose ControlNets and LoRAs have presets.
UNET_PRESETS = {"sd15": sd15.PRESETS, "sdxl": sdxl.PRESETS}
# ControlNet's conditioning embedding: three stride-2 convolutions take the control image to
# latent size (SD's 8x); tiny widths for tiny presets, the published ones otherwise.
EMBEDDING_CHANNELS = {"tiny": (8, 8, 16, 16)}
PUBLISHED_EMBEDDING_CHANNELS = (16, 32, 96, 256)
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' usual attention LoRA


def preset_controlnet(family: str, preset: str, seed: int) -> ControlNetModel:
    """A ControlNet for `family`'s `preset` UNet, float32 on the host."""
    if family not in UNET_PRESETS:
        raise ValueError(f"no ControlNet presets for family {family!r}; known: {sorted(UNET_PRESETS)}")
    unet = dict(preset_config(UNET_PRESETS[family], preset, family)["unet"])
    for unused in ("up_block_types", "sample_size"):  # a ControlNet is the UNet's encoder half
        unet.pop(unused)
    torch.manual_seed(seed)
    controlnet = ControlNetModel(
        in_channels=4, conditioning_embedding_out_channels=EMBEDDING_CHANNELS.get(preset, PUBLISHED_EMBEDDING_CHANNELS),
        **unet,
    )
    zero_initialised = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                        controlnet.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for layer in zero_initialised:
            nn.init.normal_(layer.weight, std=0.05)
    return controlnet


def preset_lora(name: str, denoiser: nn.Module, seed: int, rank: int = 4, alpha: float = 8.0) -> LoraWeights:
    """A rank-`rank` LoRA over `denoiser`'s attention projections (`LORA_TARGETS`), float32."""
    generator = torch.Generator("cpu").manual_seed(seed)
    layers = {}
    for module_name, module in denoiser.named_modules():
        if isinstance(module, nn.Linear) and module_name.endswith(LORA_TARGETS):
            down = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
            up = torch.randn(module.out_features, rank, generator=generator) * 0.05
            layers[module_name] = LoraLayer(down, up, alpha / rank)
    if not layers:
        raise ValueError(f"LoRA {name!r}: the denoiser has no layers named {LORA_TARGETS}")
    return LoraWeights(name, layers)


def save_lora_file(lora: LoraWeights, folder: str) -> str:
    """Write `lora` as diffusers writes a LoRA (`pytorch_lora_weights.safetensors`, with its
    adapter config); returns the file's path. All layers must share one rank and alpha."""
    ranks = {layer.down.shape[0] for layer in lora.layers.values()}
    alphas = {layer.scaling * layer.down.shape[0] for layer in lora.layers.values()}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"LoRA {lora.name!r}: one rank and alpha for every layer, got {ranks}, {alphas}")
    state = {}
    for module, layer in lora.layers.items():
        state[f"{module}.lora_A.weight"] = layer.down.contiguous()
        state[f"{module}.lora_B.weight"] = layer.up.contiguous()
    metadata = {"r": ranks.pop(), "lora_alpha": alphas.pop(), "target_modules": sorted(lora.layers)}
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=state, unet_lora_adapter_metadata=metadata)
    return os.path.join(folder, "pytorch_lora_weights.safetensors")

