"""The ControlNet service's replica class, in process (served for real in tests/cpu/addons_live)."""

import pytest
import torch

from stepserve.deployments.controlnet_service import ControlNetService
from stepserve.engine.addons.source import AddonKind, AddonSource

from tests.tiny import TINY

NAMES = ("canny", "depth", "pose")


def service(cache_size: int) -> ControlNetService:
    sources = [AddonSource(AddonKind.CONTROLNET, name, TINY.name, preset="tiny", seed=i) for i, name in enumerate(NAMES)]
    return ControlNetService(sources, [TINY], "cpu", cache_size=cache_size)


def call(svc: ControlNetService, name: str, rows=(2, 1), scales=(1.0, 0.5)):
    n = sum(rows)
    return svc.residuals(TINY.name, name, torch.randn(n, 4, 8, 8), torch.full((n,), 400.0),
                         {"encoder_hidden_states": torch.randn(n, 77, 32)}, torch.rand(n, 3, 64, 64), rows, scales)


def test_each_use_gets_its_rows_scaled():
    out = call(service(3), "canny")
    assert [mid.shape[0] for _, mid in out] == [2, 1] and len(out[0][0]) == 4


def test_the_popular_ones_load_at_start_and_a_miss_evicts_the_least_recent():
    svc = service(2)
    assert list(svc.nets) == [(TINY.name, "canny"), (TINY.name, "depth")] and svc.loads == 2
    call(svc, "canny")
    call(svc, "pose")  # a miss: depth was used least recently
    assert list(svc.nets) == [(TINY.name, "canny"), (TINY.name, "pose")] and svc.loads == 3
    with pytest.raises(KeyError, match="not served"):
        call(svc, "scribble")
