"""Video entries of the profiled cost model: per-SP-degree denoise fits, frames, and the step
costs the GenServe solver asks for (`step_seconds` of a batch at an SP degree)."""

from __future__ import annotations

import math

import pytest

from stepserve.policies.cost_model import (
    DENOISE,
    ROUND_OVERHEAD,
    TEXT_ENCODE,
    VAE_DECODE,
    BatchShape,
    ProfiledCostModel,
    ProfileError,
    ProfileRow,
    UnknownModelError,
    load_profile,
    read_profile,
    write_profile,
)
from stepserve.policies.genserve import StepCosts

V = "video-model"


def _rows(degrees=(1, 2)) -> list[ProfileRow]:
    out = []
    for size in (64, 128, 256):
        for d in degrees:
            for rows in (1, 2):
                ms = (1.0 + 1e-4 * size * size * 9 * rows) / d + 0.5 * (d - 1)
                out.append(ProfileRow(V, "cpu", DENOISE, size, size, rows, 9, ms, 1, "test", d))
        out.append(ProfileRow(V, "cpu", VAE_DECODE, size, size, 1, 9, 1e-3 * size * size, 1, "test"))
    out += [ProfileRow(V, "cpu", TEXT_ENCODE, 0, 0, n, 1, 2.0 + n, 1, "test") for n in (1, 2, 4)]
    return out


def video(rows=2, degree=1, size=128, frames=9, model=V):
    return BatchShape(model, size, size, rows, frames, degree)


def test_each_degree_is_fitted_on_its_own_and_frames_scale_the_work():
    model = ProfiledCostModel(_rows())
    assert model.sp_degrees(V) == (1, 2)
    one = model.denoise_seconds(video(degree=1))
    two = model.denoise_seconds(video(degree=2))
    assert one == pytest.approx((1.0 + 1e-4 * 128 * 128 * 9 * 2) / 1000, rel=1e-6)
    assert two == pytest.approx(((1.0 + 1e-4 * 128 * 128 * 9 * 2) / 2 + 0.5) / 1000, rel=1e-6)
    assert model.denoise_seconds(video(rows=1)) < one
    assert model.decode_seconds(V, 128, 128, 9) == pytest.approx(1e-3 * 128 * 128 / 1000, rel=1e-6)
    assert "denoise@sp2" in model.fit_report()[V]["components"]
    with pytest.raises(UnknownModelError, match="sp_degree 4"):
        model.denoise_seconds(video(degree=4))


def test_a_round_honours_each_batch_sp_degree():
    model = ProfiledCostModel(_rows())
    for degree in (1, 2):
        batch = video(degree=degree)
        assert model.round_seconds([batch]) == model.denoise_seconds(batch) + model.round_overhead_seconds([batch])
    assert model.round_seconds([video(degree=2)]) < model.round_seconds([video(degree=1)])
    with pytest.raises(UnknownModelError, match="sp_degree 4"):
        model.round_seconds([video(degree=4)])


def test_a_video_step_is_its_forward_at_its_degree_plus_one_round_overhead():
    model = ProfiledCostModel(_rows() + [ProfileRow(V, "cpu", ROUND_OVERHEAD, 0, 0, 1, 1, 1.5, 1, "test")])
    for rows in (1, 2):
        for degree in (1, 2):
            batch = video(rows, degree)
            assert model.step_seconds(batch) == pytest.approx(model.denoise_seconds(batch) + 1.5e-3)
    assert model.step_seconds(video(rows=1)) < model.step_seconds(video(rows=2))  # the real rows count


def test_solo_is_one_worker_at_degree_one():
    model = ProfiledCostModel(_rows())
    steps = 10
    expected = (model.text_encode_seconds(V, 2) + steps * model.step_seconds(video(degree=1))
                + model.decode_seconds(V, 128, 128, 9))
    assert model.solo_seconds(V, 128, 128, steps, True, frames=9) == pytest.approx(expected)


def test_step_costs_price_unprofiled_degrees_as_never():
    costs = ProfiledCostModel(_rows())
    assert isinstance(costs, StepCosts)  # the GenServe solver takes the profiled model as it is
    assert math.isinf(costs.step_seconds(video(degree=8)))
    assert math.isinf(costs.step_seconds(video(degree=4, rows=1)))
    assert costs.step_seconds(video(degree=2)) < costs.step_seconds(video(degree=1))


def test_sp_degree_round_trips_and_old_profiles_read_as_degree_one(tmp_path):
    path = tmp_path / "p.csv"
    write_profile(path, _rows())
    assert sorted(r.sp_degree for r in read_profile(path)) == sorted(r.sp_degree for r in _rows())
    old = tmp_path / "old.csv"  # written before the column existed (and mask_ratio, groups and slot, after it)
    lines = path.read_text().splitlines()
    old.write_text("\n".join(line.rsplit(",", 4)[0] for line in lines) + "\n")
    assert {r.sp_degree for r in read_profile(old)} == {1}


def test_sp_degree_only_on_denoise_rows():
    with pytest.raises(ProfileError, match="sp_degree"):
        ProfileRow(V, "cpu", VAE_DECODE, 64, 64, 1, 9, 1.0, 1, "test", 2)
    with pytest.raises(ProfileError, match="sp_degree"):
        ProfileRow(V, "cpu", DENOISE, 64, 64, 1, 9, 1.0, 1, "test", 0)


def test_shipped_genserve_profile_matches_its_sources():
    """The derived table reproduces the anchors it was derived from (derive_genserve_rtx6000.py)."""
    model = load_profile("genserve-rtx6000")
    step = lambda size, d: model.step_seconds(video(2, d, size, 81, "wan2.2-5b"))  # noqa: E731
    assert step(768, 1) == pytest.approx(0.78157 + 0.001, rel=1e-3)  # Table 7 + one round's RPC
    assert step(768, 1) / step(768, 8) == pytest.approx(7.0, rel=0.02)  # Fig. 5
    assert step(256, 1) / step(256, 8) < step(480, 1) / step(480, 8) < step(768, 1) / step(768, 8)
    image = BatchShape("sd3.5-medium", 768, 768, 2)
    assert step(768, 1) > 15 * model.step_seconds(image)  # "up to 20x per-step cost differences"
    assert model.step_seconds(image) == model.round_seconds([image])
