"""SynerDiff's VAE chunking: one request's `AutoencoderKL` decode, run as N sub-blocks over N rounds.

VAE decoding is memory-bandwidth bound while the denoiser is compute bound; run whole beside a
denoising step, the decode's burst of large activations starves the step (SynerDiff §II-A/B).
SynerDiff therefore "partitions the decoder into N temporally equivalent sub-blocks at the ResNet
block level" (§III-B, Fig. 5) and runs one sub-block per concurrent round, interleaved with the
denoising steps of the other requests; its offline profiler picks N (§III-C) and its feedback
controller raises it under load.

Chunking changes when the work runs, not what it computes: the sub-blocks call diffusers' own
modules, in the order and with the arguments `AutoencoderKL.decode` uses, on the same tensors,
so the result is bit-equal to `vae.decode(latents, return_dict=False)[0]` for every N. What
diffusers would compute differently (tiling, slicing, a decoder class or hooks this module does
not replay) is refused with a ValueError rather than approximated.

A worker builds a `ChunkedDecode` for a request whose denoising has finished, from the latents
it would pass to `vae.decode` (already unscaled / unshifted), calls `.step()` once per round
after that round's denoiser forward, and hands `.result` to image post-processing once `.done`.
`chunk_plan` shows a profiler the partition and the estimated cost of each sub-block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
from diffusers import AutoencoderKL
from diffusers.models.attention_processor import Attention
from diffusers.models.autoencoders.vae import Decoder
from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D, UpDecoderBlock2D
from torch import nn


@dataclass(frozen=True)
class ChunkPlan:
    """How a decode splits: `units` are decoder submodule paths in run order, `unit_costs` their
    estimated multiply-accumulates (the first also carries post_quant_conv and conv_in, the last
    conv_norm_out, conv_act and conv_out), and `sizes` the number of units in each chunk."""

    units: tuple[str, ...]
    unit_costs: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def chunks(self) -> int:
        return len(self.sizes)

    @property
    def chunk_costs(self) -> tuple[int, ...]:
        bounds = tuple(accumulate(self.sizes, initial=0))
        return tuple(sum(self.unit_costs[a:b]) for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class _Unit:
    name: str
    module: nn.Module
    run: Callable[[torch.Tensor], torch.Tensor]
    upsamples: bool


def chunk_plan(vae: AutoencoderKL, latent_shape: Sequence[int], chunks: int) -> ChunkPlan:
    """The partition `ChunkedDecode(vae, latents, chunks)` runs for latents of `latent_shape`
    ([B, C, h, w]): `chunks` contiguous runs of units whose largest estimated cost is minimal."""
    _check_decodable(vae)
    return _plan(vae, _units(vae.decoder), tuple(latent_shape), chunks)


def balanced_partition(costs: Sequence[float], chunks: int) -> tuple[int, ...]:
    """Sizes of `chunks` contiguous non-empty runs of `costs` minimising the largest run's sum
    (dynamic programme over (runs, prefix length); the decoder has a few dozen units at most)."""
    n = len(costs)
    if not 1 <= chunks <= n:
        raise ValueError(f"cannot split {n} units into {chunks} chunks: need 1 <= chunks <= {n}")
    prefix = tuple(accumulate(costs, initial=0))
    # best[k][i]: the smallest possible largest run when costs[:i] is split into k runs;
    # start[k][i]: where the last of those runs starts.
    best = [[float("inf")] * (n + 1) for _ in range(chunks + 1)]
    start = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for s in range(k - 1, i):
                largest = max(best[k - 1][s], prefix[i] - prefix[s])
                if largest < best[k][i]:
                    best[k][i], start[k][i] = largest, s
    sizes, i = [], n
    for k in range(chunks, 0, -1):
        sizes.append(i - start[k][i])
        i = start[k][i]
    return tuple(reversed(sizes))


class ChunkedDecode:
    """`vae.decode(latents, return_dict=False)[0]`, run one chunk per `step()` under the caller's
    grad mode. Between steps it holds only the current activation (and, until done, the VAE)."""

    def __init__(self, vae: AutoencoderKL, latents: torch.Tensor, chunks: int):
        _check_decodable(vae)
        self._vae = vae
        self._units = _units(vae.decoder)
        self.plan = _plan(vae, self._units, tuple(latents.shape), chunks)
        self._sample = latents
        self._chunk_index = 0
        self._next_unit = 0

    @property
    def chunks(self) -> int:
        return self.plan.chunks

    @property
    def chunk_index(self) -> int:
        """How many chunks have run."""
        return self._chunk_index

    @property
    def done(self) -> bool:
        return self._chunk_index == self.plan.chunks

    @property
    def result(self) -> torch.Tensor:
        if not self.done:
            raise RuntimeError(f"decode not finished: {self._chunk_index} of {self.chunks} chunks ran")
        return self._sample

    def step(self) -> None:
        """Run the next chunk."""
        if self.done:
            raise RuntimeError("decode already finished")
        stop = self._next_unit + self.plan.sizes[self._chunk_index]
        sample = self._sample
        if self._next_unit == 0:
            sample = _head(self._vae, sample)
        for unit in self._units[self._next_unit:stop]:
            sample = unit.run(sample)
        if stop == len(self._units):
            sample = _tail(self._vae.decoder, sample)
            self._vae, self._units = None, ()  # a finished decode keeps only its image
        self._sample, self._next_unit = sample, stop
        self._chunk_index += 1

    def run(self) -> torch.Tensor:
        """Run the remaining chunks; the decoded image."""
        while not self.done:
            self.step()
        return self.result


# ---- replaying AutoencoderKL._decode -----------------------------------------------------------


def _head(vae: AutoencoderKL, z: torch.Tensor) -> torch.Tensor:
    if vae.post_quant_conv is not None:
        z = vae.post_quant_conv(z)
    return vae.decoder.conv_in(z)


def _units(decoder: Decoder) -> tuple[_Unit, ...]:
    """Decoder.forward between conv_in and conv_norm_out with latent_embeds=None, as resnets,
    attentions and upsamplers in the order UNetMidBlock2D and UpDecoderBlock2D call them.
    Decoder.forward casts nothing between its mid and up blocks (the upscale_dtype cast lives in
    MaskConditionDecoder, which `_check_decodable` refuses), so neither does this."""
    mid = decoder.mid_block
    units = [_Unit("mid_block.resnets.0", mid.resnets[0], partial(mid.resnets[0], temb=None), False)]
    for i, (attn, resnet) in enumerate(zip(mid.attentions, mid.resnets[1:])):
        if attn is not None:
            units.append(_Unit(f"mid_block.attentions.{i}", attn, partial(attn, temb=None), False))
        units.append(_Unit(f"mid_block.resnets.{i + 1}", resnet, partial(resnet, temb=None), False))
    for b, block in enumerate(decoder.up_blocks):
        for r, resnet in enumerate(block.resnets):
            units.append(_Unit(f"up_blocks.{b}.resnets.{r}", resnet, partial(resnet, temb=None), False))
        for u, upsampler in enumerate(block.upsamplers or ()):
            units.append(_Unit(f"up_blocks.{b}.upsamplers.{u}", upsampler, upsampler, True))
    return tuple(units)


def _tail(decoder: Decoder, sample: torch.Tensor) -> torch.Tensor:
    return decoder.conv_out(decoder.conv_act(decoder.conv_norm_out(sample)))


def _check_decodable(vae: AutoencoderKL) -> None:
    """Refuse what `_units` does not replay op for op. Gradient checkpointing is not refused: it
    changes what a backward pass recomputes, not the forward's values."""
    if type(vae) is not AutoencoderKL:  # a subclass may override decode / _decode
        raise ValueError(f"chunked decode replays AutoencoderKL only, not {type(vae).__name__}")
    if vae.use_tiling or vae.use_slicing:  # tiles / slices compute a different (or differently shaped) decode
        raise ValueError("chunked decode needs a VAE with tiling and slicing disabled")
    decoder = vae.decoder
    if type(decoder) is not Decoder or type(decoder.mid_block) is not UNetMidBlock2D \
            or any(type(block) is not UpDecoderBlock2D for block in decoder.up_blocks):
        raise ValueError(f"chunked decode does not know this decoder: {type(decoder).__name__} with "
                         f"{type(decoder.mid_block).__name__}, {[type(b).__name__ for b in decoder.up_blocks]}")
    if not isinstance(decoder.conv_norm_out, nn.GroupNorm):  # SpatialNorm needs latent_embeds (MoVQ-style)
        raise ValueError("chunked decode supports the GroupNorm decoder only, not a spatial-norm one")
    # Chunking calls these modules' children directly, so hooks on the modules themselves (and
    # accelerate's offload hook that decode() triggers) would silently not run.
    if hasattr(vae, "_hf_hook") or any(_has_hooks(m) for m in (decoder, decoder.mid_block, *decoder.up_blocks)):
        raise ValueError("chunked decode cannot replay hooks on the VAE, its decoder or its blocks")


def _has_hooks(module: nn.Module) -> bool:
    registry = getattr(module, "_diffusers_hook", None)
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")
                or (registry is not None and registry.hooks))


# ---- cost estimate --------------------------------------------------------------------------


def _plan(vae: AutoencoderKL, units: Sequence[_Unit], latent_shape: tuple[int, ...], chunks: int) -> ChunkPlan:
    if len(latent_shape) != 4 or latent_shape[1] != vae.config.latent_channels:
        raise ValueError(f"latents must be [B, {vae.config.latent_channels}, h, w], not {list(latent_shape)}")
    batch, _, height, width = latent_shape
    head = [m for m in (vae.post_quant_conv, vae.decoder.conv_in) if m is not None]
    costs = []
    for unit in units:
        if unit.upsamples:  # Upsample2D: nearest x2, then its conv at the doubled size
            height, width = 2 * height, 2 * width
        costs.append(_macs(unit.module, height, width))
    costs[0] += sum(_macs(m, *latent_shape[2:]) for m in head)
    costs[-1] += _macs(vae.decoder.conv_out, height, width)
    costs = [batch * cost for cost in costs]
    return ChunkPlan(tuple(u.name for u in units), tuple(costs), balanced_partition(costs, chunks))


def _macs(module: nn.Module, height: int, width: int) -> int:
    """Multiply-accumulates of one image through `module` with outputs of height x width: every
    conv (all stride 1, 'same' padding in the decoder), every linear over the h*w tokens, and
    attention's scores and weighted sum. GroupNorm, SiLU, the residual adds and the upsampling
    copy are left out: they are a few operations per element against a conv's C*k*k, so they
    shift the balance little."""
    tokens, total = height * width, 0
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            total += m.in_channels // m.groups * m.out_channels * m.kernel_size[0] * m.kernel_size[1] * tokens
        elif isinstance(m, nn.Linear):
            total += m.in_features * m.out_features * tokens
        elif isinstance(m, Attention):
            total += tokens * tokens * (m.to_q.out_features + m.to_v.out_features)
    return total
