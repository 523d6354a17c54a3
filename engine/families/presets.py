"""What the random-weight presets are built from: the real model classes at configured sizes,
each part under a seed of its own, on the host or (full sizes) directly on the GPU in the
serving dtype."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, T5Config, T5EncoderModel

from stepserve.engine.families.base import kept_in_fp32


def preset_config(presets: Mapping[str, dict], preset: str, family: str) -> dict:
    """A family's preset by name; ValueError naming the ones it has."""
    if preset not in presets:
        raise ValueError(f"unknown {family} preset {preset!r}; known: {sorted(presets)}")
    return presets[preset]


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


def is_full(preset: str) -> bool:
    """Full presets ("full", "full-a14b"...) are published sizes, for GPU speed runs."""
    return preset.startswith("full")


def build_on(preset: str, device: torch.device) -> torch.device:
    """Where a preset's random weights are initialised: a full preset directly on the serving
    device unless that is the host (initialising billions of host weights is slow), everything
    else on the host."""
    return device if (is_full(preset) and device.type != "cpu") else torch.device("cpu")


@contextmanager
def created_as(dtype: torch.dtype) -> Iterator[None]:
    """The process-wide default dtype set to `dtype` for one model's construction, so its floating
    tensors are created in it (as transformers' `from_config(torch_dtype=...)` does it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def keep_fp32(module: Any) -> None:
    """What the class keeps in float32 (`base.kept_in_fp32`) back to float32, as loading a
    half-precision checkpoint with `from_pretrained(torch_dtype=...)` leaves it."""
    for tensor in kept_in_fp32(module).values():
        tensor.data = tensor.data.float()


def seeded_parts(builders: Mapping[str, Callable[[], Any]], wanted: Collection[str], seed: int, preset: str,
                 device: torch.device, dtype: torch.dtype = torch.float32,
                 float32_parts: Collection[str] = ()) -> dict[str, Any]:
    """The `wanted` parts of `builders`, each built under seed * 1009 + its position in
    `builders`, so a process that builds only the denoiser gets the same denoiser as one that
    builds everything. A family adds new parts at the end: earlier parts keep their seeds.

    Full presets are built in the serving `dtype` from the start (FLUX.1-dev or Wan 2.2 A14B in
    float32 would not fit one GPU before a cast), but for `float32_parts` (VAEs a family runs in
    float32); their weights are then deterministic per seed, device type and dtype. Tiny presets
    are built on the host in float32 and cast when loaded: the same weights everywhere.
    """
    out = {}
    for offset, (part, build) in enumerate(builders.items()):
        if part in wanted:
            torch.manual_seed(seed * 1009 + offset)
            built_in = dtype if is_full(preset) and part not in float32_parts else torch.float32
            with build_on(preset, device), created_as(built_in):
                out[part] = build()
            keep_fp32(out[part])
    return out
