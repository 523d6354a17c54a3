"""Latent parallelism: a CFG request split over two ranks (gloo), a row each, with ControlNets and a
LoRA, equals the diffusers pipelines alone, on both ranks alike; one that goes back to one rank
mid-way (the other releases it) does too."""

import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp

from stepserve.engine.addons import ControlRows, LoraRows, StepAddons
from stepserve.engine.addons.controlnet import StaleResiduals

from tests.addons import reference_image, write_preset_loras
from tests.latent_ranks import IMAGES, SOURCES, cfg_split_worker, served_family, spec_for
from tests.tiny_video import free_port

ATOL = 2e-5  # as the golden tests: a batch of one runs other GEMM shapes than a batch of two


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folders = {s.name: write_preset_loras(s, tmp_path_factory.mktemp(s.name)) for s in SOURCES}
    out = tmp_path_factory.mktemp("latent")
    multiprocessing.get_context("forkserver").set_forkserver_preload([cfg_split_worker.__module__])
    mp.start_processes(cfg_split_worker, args=(2, free_port(), str(out), folders), nprocs=2, join=True,
                       start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)], folders


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.family)
@pytest.mark.parametrize("case,seed", [("split", 20), ("dissolved", 30)])
def test_a_split_request_equals_its_pipeline(ranks, source, case, seed):
    (rank0, rank1), folders = ranks
    family = served_family(source, folders[source.name])
    spec = spec_for(source, case, seed + [s.name for s in SOURCES].index(source.name))
    image = family.decode(rank0[f"{source.name}/{case}"])[0]
    expected = reference_image(source, spec, IMAGES, folders[source.name])
    assert abs(image - expected).max() <= ATOL
    if case == "split":  # both ranks stepped it alike, to the bit
        assert torch.equal(rank0[f"{source.name}/split"], rank1[f"{source.name}/split"])
    else:
        assert rank1[f"{source.name}/dissolved"] is None  # it let the request go


def test_a_rank_takes_its_rows_of_the_forwards_addons():
    image = torch.arange(4.0).view(4, 1, 1, 1)
    addons = StepAddons(
        (ControlRows("canny", slice(0, 2), image[:2], 0.5, StaleResiduals()), ControlRows("depth", slice(2, 4),
                                                                                          image[2:], 1.0)),
        (LoraRows("x", slice(1, 3), 0.7),))
    mine = addons.take(slice(1, 2))
    assert [(c.name, c.rows, c.image.flatten().tolist(), c.stale) for c in mine.controls] == [
        ("canny", slice(0, 1), [1.0], None)]  # exact on a split: never stale
    assert mine.loras == (LoraRows("x", slice(0, 1), 0.7),)
    assert not addons.take(slice(4, 6))
