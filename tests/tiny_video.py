"""Shared builders for video tests: the tiny Wan models, video specs, the plain-diffusers reference,
and the workers that `torch.multiprocessing` spawns for sequence-parallel tests."""

from __future__ import annotations

import pickle
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from stepserve.engine.families import DENOISER, TEXT, ModelSource, load_family
from stepserve.engine.sampler import Conditioning, Sampler
from stepserve.engine.text_encoding import encode_conditioning, encode_pair
from stepserve.policies.types import RequestKind, RequestSpec

TINY_WAN = ModelSource(name="tiny-wan", family="wan", preset="tiny", seed=0)
TINY_WAN_A14B = ModelSource(name="tiny-wan-a14b", family="wan", preset="tiny-a14b", seed=0)
TINY_WAN_TI2V = ModelSource(name="tiny-wan-ti2v", family="wan-ti2v", preset="tiny", seed=0)


def make_video_spec(rid: str = "v", steps: int = 4, seed: int = 0, guidance: float = 5.0, height: int = 64,
                    width: int = 64, frames: int = 5, prompt: str = "a red fox runs through snow",
                    negative: str = "", model: str = "tiny-wan") -> RequestSpec:
    return RequestSpec(request_id=rid, model=model, prompt=prompt, width=width, height=height,
                       num_inference_steps=steps, guidance_scale=guidance, seed=seed, negative_prompt=negative,
                       kind=RequestKind.T2V, num_frames=frames)


def video_conditioning(family, spec) -> Conditioning:
    return encode_conditioning(family, spec)


def run_video(family, spec, conditioning, sp_group=None, steps: int | None = None) -> Sampler:
    """A fresh sampler stepped `steps` times (all of them by default)."""
    sampler = Sampler(spec, family, conditioning)
    for _ in range(sampler.steps_total if steps is None else steps):
        sampler.step(family, sp_group)
    return sampler


def finish(sampler: Sampler, family, sp_group=None) -> torch.Tensor:
    while not sampler.done:
        sampler.step(family, sp_group)
    return sampler.latents


def solo_pipeline_video(family, spec, output_type: str = "np"):
    """Plain diffusers: WanPipeline alone, same components, same seed."""
    with torch.inference_mode():
        return family.pipe(
            prompt=spec.prompt, negative_prompt=spec.negative_prompt or None, height=spec.height, width=spec.width,
            num_frames=spec.num_frames, num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale, generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type=output_type, max_sequence_length=family.max_sequence_length,
        ).frames


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Odd token count (48x48, 9 frames → 3x3x3 = 27 tokens) so ranks hold unequal shards; CFG on.
UNEVEN = dict(rid="uneven", steps=4, seed=11, guidance=5.0, height=48, width=48, frames=9, negative="blurry")
EVEN = dict(rid="even", steps=3, seed=12, guidance=1.0, height=64, width=64, frames=5)
RESUME_AFTER = 2
THREE_HEADS = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
)


def three_head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cpu").manual_seed(3)
    sample = torch.randn(2, 16, 2, 8, 6, generator=gen)  # 2 x 4 x 3 = 24 tokens
    context = torch.randn(2, 7, 32, generator=gen)
    return sample, torch.tensor([999, 500]), context


@contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[object]:
    """This process as one rank of a fresh gloo group of `world_size`; yields the group, which
    callers pass explicitly everywhere."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield dist.new_group(list(range(world_size)))
    finally:
        dist.destroy_process_group()


def sp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank of a gloo group: runs the tiny videos sequence-parallel and saves what it got."""
    from diffusers import WanTransformer3DModel

    from stepserve.engine.parallel import UlyssesWanTransformer

    with gloo_group(rank, world_size, port) as group:
        family = load_family(TINY_WAN, {TEXT, DENOISER}, "cpu")
        out: dict[str, torch.Tensor] = {}
        for params in (UNEVEN, EVEN):
            spec = make_video_spec(**params)
            cond = video_conditioning(family, spec)
            out[f"{spec.request_id}/sp"] = run_video(family, spec, cond, group).latents

        spec = make_video_spec(**UNEVEN)
        cond = video_conditioning(family, spec)
        # Paused after k steps at SP=1 on rank 0, shipped as bytes, resumed at SP=d on all ranks.
        payload = [pickle.dumps(run_video(family, spec, cond, None, RESUME_AFTER).state()) if rank == 0 else None]
        dist.broadcast_object_list(payload, src=0, group=group)
        out["sp1_then_sp"] = finish(Sampler.from_state(pickle.loads(payload[0]), family), family, group)
        # And the other way: k steps at SP=d, then each rank alone at SP=1.
        state = run_video(family, spec, cond, group, RESUME_AFTER).state()
        out["sp_then_sp1"] = finish(Sampler.from_state(state, family), family, None)

        # A head count the group size does not divide.
        torch.manual_seed(5)
        model = WanTransformer3DModel(**THREE_HEADS).eval()
        sample, t, context = three_head_inputs()
        with torch.inference_mode():
            out["three_heads/sp"] = UlyssesWanTransformer(model, group)(sample, t, context)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


# Wan 2.2 sequence-parallel cases, CFG on. A14B: 3 steps at t = 999 (high noise), 857 and 600 (low
# noise), so both transformers run split; 48x48, 9 frames: 27 tokens. TI2V: 32x96, 9 frames, so
# 3x1x3 = 9 tokens and unequal shards of the per-token timesteps.
WAN22_SP = {
    TINY_WAN_A14B: dict(rid="a14b", steps=3, seed=13, height=48, width=48, frames=9, negative="blurry"),
    TINY_WAN_TI2V: dict(rid="ti2v", steps=3, seed=14, height=32, width=96, frames=9, negative="blurry"),
}


def sp_worker_wan22(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank of a gloo group: each Wan 2.2 case sequence-parallel, saved by request id."""
    with gloo_group(rank, world_size, port) as group:
        out: dict[str, torch.Tensor] = {}
        for source, params in WAN22_SP.items():
            family = load_family(source, {TEXT, DENOISER}, "cpu")
            spec = make_video_spec(model=source.name, **params)
            out[spec.request_id] = run_video(family, spec, video_conditioning(family, spec), group).latents
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def video_embeds(family, spec) -> tuple:
    """(prompt, negative or None) numpy arrays, as the text encoder deployment returns them."""
    return encode_pair(family, spec)
