"""A worker's side of the ControlNet service (`deployments.controlnet_service`): one Serve call per
ControlNet of a forward, sent before the worker's UNet starts and awaited once its mid block is done
(`engine.addons.overlap`)."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stepserve.engine.addons.controlnet import ControlRows, Residuals, group_rows, inputs_to, rows_of


class ServiceControlNets:
    """`engine.addons.controlnet.ControlNetService` over a handle to the deployment."""

    def __init__(self, handle: Any):
        # The worker calls from its plan's thread, outside any event loop, so the handle must run
        # its request routing on a loop of its own. Serve would take that from the environment,
        # which the worker inherits from the router (`serve_one_loop` turns it off there).
        handle._init(_run_router_in_separate_loop=True)
        self.handle = handle

    def start(self, model: str, name: str, sample: torch.Tensor, timesteps: torch.Tensor,
              inputs: Mapping[str, Any], group: Sequence[ControlRows]) -> Callable[[], list[Residuals]]:
        index = group_rows(group).to(sample.device)
        response = self.handle.residuals.remote(
            model, name, sample[index].cpu(), timesteps[index].cpu(), inputs_to(rows_of(inputs, index), "cpu"),
            torch.cat([use.image for use in group]).cpu(), [use.rows.stop - use.rows.start for use in group],
            [use.scale for use in group])

        @functools.cache  # asked for now by some uses and at the next step by stale ones
        def wait() -> list[Residuals]:
            return [([d.to(sample.device) for d in down], mid.to(sample.device)) for down, mid in response.result()]
        return wait


class InProcessControlNets:
    """The service's replica class in this process, each call on a thread so the UNet's encoder
    half runs meanwhile as it does beside the deployment: for benchmarks and tests of what the
    service computes (the deployment itself is tested live)."""

    def __init__(self, service: Any, threads: int = 2):
        self.service = service
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)

    def start(self, model: str, name: str, sample: torch.Tensor, timesteps: torch.Tensor,
              inputs: Mapping[str, Any], group: Sequence[ControlRows]) -> Callable[[], list[Residuals]]:
        index = group_rows(group).to(sample.device)
        future = self.pool.submit(self.service.residuals, model, name, sample[index], timesteps[index],
                                  rows_of(inputs, index), torch.cat([use.image for use in group]),
                                  [use.rows.stop - use.rows.start for use in group], [use.scale for use in group])
        return future.result

