"""Ulysses sequence parallelism: SP=2 over gloo equals SP=1; a video paused at one degree
resumes at another and still equals the uninterrupted run."""

import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp
from diffusers import WanTransformer3DModel

from stepserve.engine.families import DENOISER, TEXT, load_family
from stepserve.engine.parallel import UlyssesLayout, even_split

from tests.tiny_video import (
    EVEN, THREE_HEADS, TINY_WAN, UNEVEN, free_port, make_video_spec, run_video, sp_worker, three_head_inputs,
    video_conditioning,
)

WORLD = 2
ATOL = 2e-5  # fp32 CPU: a split sequence changes GEMM shapes (and so rounding) only


def test_even_split_and_layout():
    assert even_split(27, 2) == (14, 13)
    assert even_split(12, 8) == (2, 2, 2, 2, 1, 1, 1, 1)  # Wan2.1-1.3B's heads over 8 ranks
    layout = UlyssesLayout.plan(num_tokens=27, num_heads=3, world_size=2, rank=1)
    assert layout.tokens == (14, 13) and layout.heads == (2, 1)
    assert layout.token_slice == slice(14, 27)
    assert UlyssesLayout.plan(32, 8, 1, 0).token_slice == slice(0, 32)


def test_layout_rejects_what_cannot_be_split():
    with pytest.raises(ValueError, match="at least 8 attention heads"):
        UlyssesLayout.plan(num_tokens=64, num_heads=4, world_size=8, rank=0)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        UlyssesLayout.plan(num_tokens=3, num_heads=8, world_size=4, rank=0)
    with pytest.raises(ValueError, match="not in a group"):
        UlyssesLayout.plan(num_tokens=8, num_heads=8, world_size=2, rank=2)


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    """Runs every multi-rank case in one group of WORLD fresh processes. A fork server that has
    imported the engine once forks them: spawning each would re-import torch and diffusers per
    rank (~15 s on 2 cores), and forking the test process itself is unsafe once it has threads."""
    out = tmp_path_factory.mktemp("ulysses")
    multiprocessing.get_context("forkserver").set_forkserver_preload([sp_worker.__module__])
    mp.start_processes(sp_worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def family():
    return load_family(TINY_WAN, {TEXT, DENOISER}, "cpu")


def _sp1(family, params):
    spec = make_video_spec(**params)
    return run_video(family, spec, video_conditioning(family, spec)).latents


def test_ranks_agree_exactly(sp_results):
    first, *others = sp_results
    for other in others:
        assert first.keys() == other.keys()
        for key in first:
            assert torch.equal(first[key], other[key]), key


@pytest.mark.parametrize("params", [UNEVEN, EVEN], ids=["27-tokens-cfg", "32-tokens-no-cfg"])
def test_sp2_equals_sp1(sp_results, family, params):
    expected = _sp1(family, params)
    got = sp_results[0][f"{params['rid']}/sp"]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_resume_at_another_degree_equals_uninterrupted(sp_results, family):
    expected = _sp1(family, UNEVEN)
    assert not torch.allclose(expected, _sp1(family, {**UNEVEN, "seed": 99}))  # the test can fail
    for rank in range(WORLD):
        torch.testing.assert_close(sp_results[rank]["sp1_then_sp"], expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(sp_results[rank]["sp_then_sp1"], expected, atol=ATOL, rtol=0)


def test_head_count_not_divisible_by_degree(sp_results):
    torch.manual_seed(5)
    model = WanTransformer3DModel(**THREE_HEADS).eval()
    sample, t, context = three_head_inputs()
    with torch.inference_mode():
        expected = model(sample, t, context, return_dict=False)[0]
    torch.testing.assert_close(sp_results[0]["three_heads/sp"], expected, atol=1e-5, rtol=0)
