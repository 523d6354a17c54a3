"""What the random-weight presets are built from: the real model classes at configured sizes,
each part under a seed of its own, on the host or (full sizes) directly on the GPU."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, T5Config, T5EncoderModel


def clip_text_config(cfg: dict) -> CLIPTextConfig:
    # Token ids follow the byte-level tokenizer: bos 0, eos (= pad) 1.
    return CLIPTextConfig(max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1, **cfg)


def t5_encoder(cfg: dict) -> T5EncoderModel:
    # T5 v1.1's gated GELU; token ids follow the character-level tokenizer: pad 0, eos 1.
    config = T5Config(feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                      **cfg)
    return T5EncoderModel(config)


def autoencoder_kl(cfg: dict) -> AutoencoderKL:
    """An image VAE with one encoder and one decoder block per entry of `block_out_channels`
    (four give SD's 8x downscale); `cfg` may override any other argument (latent channels...)."""
    n = len(cfg["block_out_channels"])
    return AutoencoderKL(**{
        "in_channels": 3, "out_channels": 3, "latent_channels": 4,
        "down_block_types": ("DownEncoderBlock2D",) * n, "up_block_types": ("UpDecoderBlock2D",) * n, **cfg,
    })


def vae_geometry(vae_config: dict) -> dict[str, int]:
    """An image VAE's downscale and latent channels, from its config (what every process needs to
    know about latents, whichever parts it loaded)."""
    return {"vae_scale_factor": 2 ** (len(vae_config["block_out_channels"]) - 1),
            "latent_channels": vae_config.get("latent_channels", 4)}


def build_on(preset: str, device: torch.device) -> torch.device:
    """Where a preset's random weights are initialised: a full preset directly on a CUDA device
    (initialising a billion host weights is slow; its weights are then deterministic per seed
    and device type), everything else on the host."""
    return device if (preset == "full" and device.type == "cuda") else torch.device("cpu")


def seeded_parts(builders: Mapping[str, Callable[[], Any]], wanted: Collection[str], seed: int, preset: str,
                 device: torch.device) -> dict[str, Any]:
    """The `wanted` parts of `builders`, each built under seed * 1009 + its position in
    `builders`, so a process that builds only the denoiser gets the same denoiser as one that
    builds everything. A family adds new parts at the end: earlier parts keep their seeds."""
    out = {}
    for offset, (part, build) in enumerate(builders.items()):
        if part in wanted:
            torch.manual_seed(seed * 1009 + offset)
            with build_on(preset, device):
                out[part] = build()
    return out
