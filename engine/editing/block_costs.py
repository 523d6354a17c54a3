"""Measured per-block costs of a masked SD3 forward, the numbers the bubble-free DP plans with
(InstGenIE §4.2, Algorithm 1: C_w, C_wo and L of every block).

Here, in the engine, rather than in a benchmark: they depend on the device, the model, the
resolution, the rows and the mask ratio, so a worker (or `stepserve profile`) measures them on
its own device for the shapes it serves and the policies' DP reads them; the cache-loading
benchmark uses the same function.

Each block is timed alone on its own input from a plain forward (captured with forward
pre-hooks, so the model's own forward runs): in full, masked with its cached slot already on the
device, and the copy of that slot from host memory (or, given `load_slot`, whatever loading a
slot is: on a CPU node, reading it from the activation store's disk, `record_file.RecordFile`).
A `KEYS_VALUES` record has one more slot, the final image tokens, needed by the output layer
after the last block: its costs are the output layer's (masked: the masked tokens, then the
scatter into the slot), as one more entry, so the DP sees the forward as the loader runs it
(that slot's copy queued after the last block's). On CUDA every sample is timed with events
around the work on the current stream after a synchronize; on CPU with the wall clock. Loads are
timed alone, not under concurrent compute: sharing memory bandwidth with the kernels may slow
them a little, which the benchmark's measured-against-predicted shows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from diffusers import SD3Transformer2DModel

from stepserve.engine.editing.masked_block import keys_values_block_forward, masked_block_forward
from stepserve.engine.editing.masked_sd3 import CacheKind, SD3Inputs, cache_slots, plain_forward
from stepserve.kernels.masked_attention import gather_tokens, scatter_tokens


class BlockCosts(NamedTuple):
    """Seconds per cache slot (per block, and the output layer for `KEYS_VALUES`), in slot order;
    unpacks as `pipeline_dp.plan`'s three cost arguments."""

    c_with: tuple[float, ...]  # computing the masked tokens, the rest from the cache
    c_without: tuple[float, ...]  # computing every token
    load: tuple[float, ...]  # copying the slot to the device (0 on CPU: no copy), or `load_slot`


def measure_block_costs(transformer: SD3Transformer2DModel, inputs: SD3Inputs, plan_index: torch.Tensor,
                        cached: Sequence[torch.Tensor], device: torch.device | str, warmup: int = 1,
                        repeats: int = 5, kind: CacheKind = CacheKind.OUTPUTS,
                        load_slot: Callable[[int], Any] | None = None) -> BlockCosts:
    """Median per-slot costs of a masked forward of `inputs` computing the tokens `plan_index`
    [B, M], with `cached[s]` slot s of a record of `kind` in host memory (pinned, as the loader
    reads it, or the load times are those of pageable copies). `load_slot(s)`, when given, is
    what loading slot s takes (timed for L instead of the copy)."""
    device = torch.device(device)
    kind = CacheKind(kind)
    slots = cache_slots(transformer, kind)
    if len(cached) != slots:
        raise ValueError(f"{len(cached)} cached slots for a {kind.value} record of {slots}")
    block_inputs, final_input = _block_inputs(transformer, inputs)
    timed = _timer(device)

    def median(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median([timed(fn) for _ in range(repeats)])

    def masked_block(block: Any, kwargs: dict[str, torch.Tensor], on_device: torch.Tensor) -> Callable[[], Any]:
        hidden, context, temb = kwargs["hidden_states"], kwargs["encoder_hidden_states"], kwargs["temb"]
        if kind is CacheKind.OUTPUTS:
            return lambda: masked_block_forward(block, hidden, context, temb, plan_index, on_device)
        masked = gather_tokens(hidden, plan_index)  # what the previous masked block hands on
        return lambda: keys_values_block_forward(block, masked, context, temb, plan_index, on_device)

    def output_layer(hidden: torch.Tensor) -> torch.Tensor:
        return transformer.proj_out(transformer.norm_out(hidden, final_input["temb"]))

    c_with, c_without, load = [], [], []
    with torch.inference_mode():  # each lambda below is timed at once, so it sees this iteration's slot
        for slot, host in enumerate(cached):
            on_device = host.to(device)
            if slot < len(block_inputs):
                block, kwargs = transformer.transformer_blocks[slot], block_inputs[slot]
                c_without.append(median(lambda: block(**kwargs)))
                c_with.append(median(masked_block(block, kwargs, on_device)))
            else:  # the final image tokens
                hidden = final_input["hidden_states"]
                masked = gather_tokens(hidden, plan_index)
                c_without.append(median(lambda: output_layer(hidden)))
                c_with.append(median(lambda: scatter_tokens(on_device, plan_index, output_layer(masked))))
            if load_slot is not None:
                load.append(median(lambda: load_slot(slot)))
            elif device.type == "cuda":
                target = torch.empty_like(host, device=device)
                load.append(median(lambda: target.copy_(host, non_blocking=host.is_pinned())))
            else:
                load.append(0.0)
    return BlockCosts(tuple(c_with), tuple(c_without), tuple(load))


def _block_inputs(transformer: SD3Transformer2DModel,
                  inputs: SD3Inputs) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Every block's keyword arguments (hidden_states, encoder_hidden_states, temb) in a plain
    forward of `inputs`, and the output layer's input (its hidden_states and temb)."""
    captured: list[dict[str, torch.Tensor]] = []
    final: dict[str, torch.Tensor] = {}
    hooks = [block.register_forward_pre_hook(lambda _, args, kwargs: captured.append(dict(kwargs)), with_kwargs=True)
             for block in transformer.transformer_blocks]
    hooks.append(transformer.norm_out.register_forward_pre_hook(
        lambda _, args: final.update(hidden_states=args[0], temb=args[1])))
    try:
        plain_forward(transformer, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return captured, final


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
