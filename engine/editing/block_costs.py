"""Measured per-block costs of a masked SD3 forward, the numbers the bubble-free DP plans with
(InstGenIE §4.2, Algorithm 1: C_w, C_wo and L of every block).

Here, in the engine, rather than in a benchmark: they depend on the device, the model, the
resolution, the rows and the mask ratio, so a worker (or `stepserve profile`) measures them on
its own device for the shapes it serves and the policies' DP reads them; the cache-loading
benchmark uses the same function.

Each block is timed alone on its own input from a plain forward (captured with forward
pre-hooks, so the model's own forward runs): in full, masked with its cached output already on
the device, and the copy of that cached output from host memory. On CUDA every sample is timed
with events around the work on the current stream after a synchronize; on CPU with the wall
clock. Loads are timed alone, not under concurrent compute: sharing memory bandwidth with the
kernels may slow them a little, which the benchmark's measured-against-predicted shows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from diffusers import SD3Transformer2DModel

from stepserve.engine.editing.masked_block import masked_block_forward
from stepserve.engine.editing.masked_sd3 import SD3Inputs, plain_forward


class BlockCosts(NamedTuple):
    """Seconds per block, in block order; unpacks as `pipeline_dp.plan`'s three cost arguments."""

    c_with: tuple[float, ...]  # computing the masked tokens, the rest from the cache
    c_without: tuple[float, ...]  # computing every token
    load: tuple[float, ...]  # copying the block's cached output to the device (0 on CPU: no copy)


def measure_block_costs(transformer: SD3Transformer2DModel, inputs: SD3Inputs, plan_index: torch.Tensor,
                        cached: Sequence[torch.Tensor], device: torch.device | str, warmup: int = 1,
                        repeats: int = 5) -> BlockCosts:
    """Median per-block costs of a masked forward of `inputs` computing the tokens `plan_index`
    [B, M], with `cached[b]` block b's cached output [B, L, H] in host memory (pinned, as the
    loader reads it, or the load times are those of pageable copies)."""
    device = torch.device(device)
    blocks = transformer.transformer_blocks
    if len(cached) != len(blocks):
        raise ValueError(f"{len(cached)} cached outputs for {len(blocks)} blocks")
    block_inputs = _block_inputs(transformer, inputs)
    timed = _timer(device)

    def median(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median([timed(fn) for _ in range(repeats)])

    c_with, c_without, load = [], [], []
    with torch.inference_mode():  # each lambda below is timed at once, so it sees this iteration's block
        for block, kwargs, host in zip(blocks, block_inputs, cached):
            c_without.append(median(lambda: block(**kwargs)))
            hidden, context, temb = kwargs["hidden_states"], kwargs["encoder_hidden_states"], kwargs["temb"]
            on_device = host.to(device)
            c_with.append(median(lambda: masked_block_forward(block, hidden, context, temb, plan_index, on_device)))
            if device.type == "cuda":
                target = torch.empty_like(host, device=device)
                load.append(median(lambda: target.copy_(host, non_blocking=host.is_pinned())))
            else:
                load.append(0.0)
    return BlockCosts(tuple(c_with), tuple(c_without), tuple(load))


def _block_inputs(transformer: SD3Transformer2DModel, inputs: SD3Inputs) -> list[dict[str, torch.Tensor]]:
    """Every block's keyword arguments (hidden_states, encoder_hidden_states, temb) in a plain
    forward of `inputs`."""
    captured: list[dict[str, torch.Tensor]] = []
    hooks = [block.register_forward_pre_hook(lambda _, args, kwargs: captured.append(dict(kwargs)), with_kwargs=True)
             for block in transformer.transformer_blocks]
    try:
        plain_forward(transformer, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds one call's work takes on `device`."""
    if device.type != "cuda":
        def wall(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return wall

    def events(fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # the sample starts with nothing else queued
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s
    return events
