"""Wan 2.2 in the wan families: T2V-A14B (a high-noise and a low-noise transformer, switched at a
boundary timestep) and TI2V-5B (the Wan 2.2 VAE, a timestep per token). A request served in a
mixed batch equals `WanPipeline` alone; paused, moved and resumed it equals an uninterrupted one;
sequence-parallel it equals one rank alone."""

import json
import multiprocessing
import pickle
import shutil
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from stepserve.engine.families import ALL_PARTS, DENOISER, TEXT, VAE, ModelSource, family_class, load_family
from stepserve.engine.families.wan import (
    FULL, FULL_A14B, FULL_TI2V, PRESETS, TI2V_PRESETS, TRANSFORMER_2, WanTI2VFamily, build_preset_components,
)
from stepserve.engine.sampler import Sampler
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny_video import (
    TINY_WAN_A14B, TINY_WAN_TI2V, WAN22_SP, free_port, make_video_spec, run_video, solo_pipeline_video,
    sp_worker_wan22, video_conditioning,
)

LATENT_ATOL = 1e-5  # fp32 CPU, as test_wan: batching changes GEMM shapes (and so rounding) only
FRAME_ATOL = 2e-5
SP_ATOL = 2e-5  # as test_ulysses
VARIANTS = {"a14b": TINY_WAN_A14B, "ti2v": TINY_WAN_TI2V}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family(request):
    return load_family(VARIANTS[request.param], ALL_PARTS, "cpu")


@pytest.fixture(scope="module")
def a14b():
    return load_family(TINY_WAN_A14B, ALL_PARTS, "cpu")


def spec_for(family, rid, **params):
    return make_video_spec(rid, model=family.source.name, **params)


def admission(family, spec) -> Admission:
    return Admission(spec, conditioning=video_conditioning(family, spec))


def is_high_noise(family, t) -> torch.Tensor:
    return t >= 0.875 * family.pipe.scheduler.config.num_train_timesteps


# ---- what the presets build ---------------------------------------------------------------


def test_a14b_preset_has_two_transformers(a14b):
    assert a14b.boundary_ratio == a14b.pipe.config.boundary_ratio == 0.875 and a14b.boundary_timestep == 875.0
    assert a14b.pipe.transformer_2 is a14b.transformer_2 and not a14b.pipe.config.expand_timesteps
    assert a14b.transformer.config == a14b.transformer_2.config
    assert not torch.equal(next(a14b.transformer.parameters()), next(a14b.transformer_2.parameters()))
    # A denoiser-only process (a worker) builds both, the same ones.
    only = load_family(TINY_WAN_A14B, {DENOISER}, "cpu")
    for mine, theirs in [(only.transformer, a14b.transformer), (only.transformer_2, a14b.transformer_2)]:
        assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters()))
    assert family_class("wan").size_multiple == 16  # Wan 2.1's VAE: served and validated as Wan 2.1


def test_ti2v_preset_and_class():
    ti2v = load_family(TINY_WAN_TI2V, {DENOISER}, "cpu")
    assert family_class("wan-ti2v") is WanTI2VFamily and type(ti2v) is WanTI2VFamily
    assert ti2v.pipe.config.expand_timesteps and ti2v.boundary_ratio is None and ti2v.transformer_2 is None
    patch = ti2v.transformer.config.patch_size[1]
    assert ti2v.vae_scale_factor * patch == WanTI2VFamily.size_multiple == 32
    assert ti2v.latent_shape(*ti2v.video_shape(32, 64, 9)) == (1, 48, 3, 2, 4)
    with pytest.raises(ValueError, match="divisible by 32"):  # the pipeline would shrink it to 32x64
        ti2v.video_shape(48, 64, 5)
    # Per-token timesteps as the pipeline builds them: each row's t on all of its tokens.
    sample = torch.zeros(2, 48, 3, 2, 4)
    per_token = ti2v._per_token(ti2v.transformer, sample, torch.tensor([999, 600]))
    assert per_token.dtype == torch.float32 and per_token.shape == (2, 3 * 1 * 2)
    assert per_token[0].eq(999).all() and per_token[1].eq(600).all()


def test_tiny_step_is_fast(family):
    spec = spec_for(family, "fast", height=32, width=32, frames=5, guidance=5.0)
    sampler = Sampler(spec, family, video_conditioning(family, spec))
    sampler.step(family)  # warm-up
    start = time.perf_counter()
    sampler.step(family)
    assert time.perf_counter() - start < 1.0  # milliseconds unloaded; a shared 2-core machine is noisy


# ---- a request in a mixed batch equals the pipeline alone --------------------------------


def run_batched(family, arrivals: dict[int, list]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Drive a StepRunner as continuous batching does: everyone resident steps in one forward each
    round, newcomers join at step boundaries. Returns each request's final latents (checkpointed
    at its last step, so they come back undecoded) and each forward's row timesteps."""
    runner = StepRunner("w0", {family.source.name: family})
    forwards: list[torch.Tensor] = []
    denoise = family.denoise

    def spy(sample, timesteps, cond, sp_group=None):
        forwards.append(timesteps.clone())
        return denoise(sample, timesteps, cond, sp_group=sp_group)

    family.denoise = spy
    left: dict[str, int] = {}
    done = {}
    try:
        for rnd in range(max(arrivals) + 100):
            new = arrivals.get(rnd, [])
            left.update({s.request_id: s.num_inference_steps for s in new})
            if not left:
                if rnd >= max(arrivals):
                    break
                continue
            last = tuple(rid for rid in left if left[rid] == 1)
            plan = WorkerPlan("w0", admit=tuple(s.request_id for s in new), groups=(StepGroup(tuple(left)),),
                              checkpoint=last, release=last)
            report, states = runner.execute(plan, {s.request_id: admission(family, s) for s in new})
            assert not report.failed, report.failed
            for rid in list(left):
                left[rid] -= 1
            for rid, state in zip(last, states):
                done[rid] = state["latents"]
                del left[rid]
    finally:
        del family.denoise  # the class's method again
    return done, forwards


def test_mixed_batch_equals_solo_pipeline(family):
    target = spec_for(family, "target", steps=6, seed=42, guidance=5.0, negative="blurry, static")
    others = [
        spec_for(family, "b", steps=4, seed=2, guidance=1.0, prompt="no cfg here"),
        spec_for(family, "c", steps=3, seed=3, guidance=7.0, prompt="a late joiner", negative="dark"),
    ]
    latents, forwards = run_batched(family, {0: [target], 2: [others[0]], 3: [others[1]]})
    assert set(latents) == {"target", "b", "c"}
    assert any(len(set(t.tolist())) > 1 for t in forwards)  # rows at different timesteps in one forward
    if family.boundary_ratio is not None:  # and, for A14B, on both sides of the boundary
        assert any(is_high_noise(family, t).any() and not is_high_noise(family, t).all() for t in forwards)
    for spec in [target, *others]:
        torch.testing.assert_close(latents[spec.request_id], solo_pipeline_video(family, spec, "latent"),
                                   atol=LATENT_ATOL, rtol=0, msg=spec.request_id)
    if family.expand_timesteps:  # the Wan 2.2 VAE's decode (A14B's is Wan 2.1's, see test_wan)
        np.testing.assert_allclose(family.decode(latents["target"]), solo_pipeline_video(family, target),
                                   atol=FRAME_ATOL)


def test_a14b_rows_go_back_in_order(a14b):
    """Rows interleaved across the boundary: each equals its own transformer's output."""
    gen = torch.Generator("cpu").manual_seed(0)
    sample = torch.randn(3, 16, 2, 4, 4, generator=gen)
    context = torch.randn(3, 32, 32, generator=gen)
    timesteps = torch.tensor([600, 999, 857])
    out = a14b.denoise(sample, timesteps, {"context": context})
    with torch.inference_mode():
        for row, model in enumerate([a14b.transformer_2, a14b.transformer, a14b.transformer_2]):
            alone = model(sample[row:row + 1], timesteps[row:row + 1], context[row:row + 1], return_dict=False)[0]
            torch.testing.assert_close(out[row:row + 1], alone, atol=LATENT_ATOL, rtol=0)


# ---- pause, move, resume ---------------------------------------------------------------------


def test_paused_and_moved_equals_uninterrupted(family):
    """Exported by one worker after 2 steps (for A14B: the last high-noise one), pickled, admitted
    from that state by a worker that loaded only the denoiser, finished there."""
    spec = spec_for(family, "moved", steps=5, seed=21, guidance=5.0, frames=9, negative="blurry")
    uninterrupted = run_video(family, spec, video_conditioning(family, spec)).latents
    step = (StepGroup(("moved",)),)
    first = StepRunner("w0", {family.source.name: family})
    first.execute(WorkerPlan("w0", admit=("moved",), groups=step), {"moved": admission(family, spec)})
    _, (state,) = first.execute(WorkerPlan("w0", groups=step, export=("moved",)), {})
    assert state["step_index"] == 2 and first.resident == ()
    if family.boundary_ratio is not None:
        t = state["scheduler"]["attrs"]["timesteps"]
        assert is_high_noise(family, t[1]) and not is_high_noise(family, t[2])  # the switch is after the move
    other = load_family(family.source, {DENOISER}, "cpu")
    second = StepRunner("w1", {other.source.name: other})
    resume = {"moved": Admission(spec, state=pickle.loads(pickle.dumps(state)))}
    second.execute(WorkerPlan("w1", admit=("moved",), groups=step), resume)
    second.execute(WorkerPlan("w1", groups=step), {})
    _, (final,) = second.execute(WorkerPlan("w1", groups=step, checkpoint=("moved",)), {})
    assert final["step_index"] == 5
    assert torch.equal(final["latents"], uninterrupted)


# ---- sequence parallel -------------------------------------------------------------------


def test_sp2_equals_sp1(tmp_path):
    """Degree 2 over gloo: A14B through both transformers, TI2V with per-token timesteps split."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([sp_worker_wan22.__module__])
    mp.start_processes(sp_worker_wan22, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="forkserver")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for source, params in WAN22_SP.items():
        family = load_family(source, {TEXT, DENOISER}, "cpu")
        spec = make_video_spec(model=source.name, **params)
        expected = run_video(family, spec, video_conditioning(family, spec)).latents
        assert torch.equal(ranks[0][spec.request_id], ranks[1][spec.request_id])
        torch.testing.assert_close(ranks[0][spec.request_id], expected, atol=SP_ATOL, rtol=0)


# ---- local folders -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(family, tmp_path_factory):
    path = tmp_path_factory.mktemp("wan22")
    family.pipe.save_pretrained(path, safe_serialization=True)
    return path


def test_local_safetensors_folder_round_trip(family, saved):
    index = json.loads((saved / "model_index.json").read_text())
    assert index["boundary_ratio"] == family.boundary_ratio
    assert index["expand_timesteps"] == family.expand_timesteps
    assert (index["transformer_2"][1] is not None) == (family.transformer_2 is not None)
    loaded = load_family(ModelSource(name=family.source.name, family=family.source.family, path=str(saved)),
                         ALL_PARTS, "cpu")
    assert type(loaded) is type(family) and loaded.boundary_timestep == family.boundary_timestep
    scheduler = (loaded.pipe.scheduler, family.pipe.scheduler)
    assert [{k: v for k, v in s.config.items() if not k.startswith("_")} for s in scheduler] == \
        [{k: v for k, v in family.pipe.scheduler.config.items() if not k.startswith("_")}] * 2
    for name in ("transformer", "transformer_2", "vae", "text_encoder"):
        mine, theirs = getattr(loaded.pipe, name), getattr(family.pipe, name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:
            assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
    loaded.max_sequence_length = family.max_sequence_length  # folders default to the pipeline's 512
    spec = spec_for(family, "local", steps=3, seed=5)
    assert torch.equal(run_video(loaded, spec, video_conditioning(loaded, spec)).latents,
                       run_video(family, spec, video_conditioning(family, spec)).latents)


def test_folder_served_as_the_wrong_variant_is_refused(family, saved):
    other = "wan" if family.expand_timesteps else "wan-ti2v"
    right = family.source.family
    with pytest.raises(ValueError, match=f"expand_timesteps={family.expand_timesteps}; serve it as family '{right}'"):
        load_family(ModelSource(name="wrong", family=other, path=str(saved)), {DENOISER}, "cpu")


def test_a14b_folder_needs_both_transformer_2_and_boundary(a14b, tmp_path):
    a14b.pipe.save_pretrained(tmp_path / "ok", safe_serialization=True)
    for name, change in [("no-boundary", {"boundary_ratio": None}), ("no-t2", {"transformer_2": [None, None]})]:
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        index_path = tmp_path / name / "model_index.json"
        index_path.write_text(json.dumps({**json.loads(index_path.read_text()), **change}))
        with pytest.raises(ValueError, match="Wan 2.2 A14B needs both"):
            load_family(ModelSource(name=name, family="wan", path=str(tmp_path / name)), {DENOISER}, "cpu")


# ---- full presets: published sizes, never built here -----------------------------------------


def test_full_presets_have_published_sizes():
    """On the meta device, in bfloat16: sizes and dtypes only, no weights."""
    meta, parts = torch.device("meta"), {DENOISER, VAE}
    a14b = build_preset_components("full-a14b", 0, parts, meta, PRESETS, torch.bfloat16)
    config = a14b[DENOISER].config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim, config.ffn_dim,
            config.text_dim, config.in_channels) == (40, 40, 128, 13824, 4096, 16)
    assert a14b[TRANSFORMER_2].config == config and a14b["boundary_ratio"] == 0.875
    for model in (a14b[DENOISER], a14b[TRANSFORMER_2]):
        assert 14e9 < sum(p.numel() for p in model.parameters()) < 14.5e9
        # Built in the serving dtype (no float32 copy of 57 GB), what diffusers keeps in float32 kept so.
        assert model.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16
        assert model.scale_shift_table.dtype == model.condition_embedder.time_embedder.linear_1.weight.dtype \
            == torch.float32
    assert a14b[VAE].config.z_dim == 16 and a14b["vae_scale_factors"] == (4, 8)  # Wan 2.1's VAE
    assert next(a14b[VAE].parameters()).dtype == torch.float32

    ti2v = build_preset_components("full", 0, parts, meta, TI2V_PRESETS, torch.bfloat16)
    config = ti2v[DENOISER].config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim, config.ffn_dim,
            config.in_channels, config.out_channels) == (30, 24, 128, 14336, 48, 48)
    assert 4.9e9 < sum(p.numel() for p in ti2v[DENOISER].parameters()) < 5.1e9
    vae = ti2v[VAE].config
    assert (vae.base_dim, vae.decoder_base_dim, vae.z_dim, vae.is_residual, vae.in_channels, vae.out_channels,
            vae.patch_size, vae.scale_factor_temporal, vae.scale_factor_spatial) == \
        (160, 256, 48, True, 12, 12, 2, 4, 16)
    assert len(vae.latents_mean) == len(vae.latents_std) == 48
    assert ti2v["expand_timesteps"] and ti2v["scheduler"].config.flow_shift == 5.0
    assert FULL_A14B["text"] == FULL_TI2V["text"] == FULL["text"]  # umt5-xxl's encoder for all
