"""Workload specs: YAML parsing, validation errors, arrival processes, the mix, SLO deadlines."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from stepserve.load_tests.workload import (
    WORKLOADS_DIR, BurstArrivals, GammaArrivals, PoissonArrivals, PoissonWorkload, TraceArrivals, WorkloadError,
    WorkloadSpec, describe, generate, load_workload, parse_workload,
)

from tests.cpu.load_tests.costs import BatchingCost, ConstantCost

BASE = {
    "seed": 3,
    "num_requests": 200,
    "arrival": {"process": "poisson", "rate": 4},
    "classes": [{"name": "a", "model": "sd", "sizes": ["64x64"], "steps": [10, 20]}],
}


def spec_with(**changes) -> WorkloadSpec:
    return parse_workload({**BASE, **changes})


# -- parsing and validation --------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(WORKLOADS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_workload_loads_and_generates(path):
    spec = load_workload(path)
    assert spec.name == path.stem
    requests = generate(replace(spec, num_requests=50, duration_s=None) if not isinstance(
        spec.arrival, TraceArrivals) else spec, ConstantCost())
    assert requests and all(r.model for r in requests)
    assert all(r.slo_s is not None for r in requests) == (spec.slo_scale is not None)
    describe(spec)  # JSON-ready


def test_shipped_workloads_by_name_and_their_paper_settings():
    synerdiff = load_workload("synerdiff-mixed")
    assert isinstance(synerdiff.arrival, PoissonArrivals) and synerdiff.num_requests == 5000
    [sd15] = synerdiff.classes
    assert {(s.width, s.height) for s in sd15.sizes} == {(512, 512), (768, 768), (1024, 1024)}
    assert min(sd15.steps.values) == 20 and max(sd15.steps.values) == 50
    patched = load_workload("patchedserve-poisson")
    assert patched.slo_scale == 5 and patched.classes[0].steps.values == (50,)
    tiny = load_workload("local-tiny")
    assert tiny.classes[0].model == "tiny-sd" and tiny.mean_rate == 3 and tiny.duration_s == 75
    with pytest.raises(WorkloadError, match="shipped"):
        load_workload("no-such-workload")


def test_sizes_and_steps_forms():
    spec = spec_with(classes=[{
        "name": "a", "model": "sd", "steps": {"min": 20, "max": 22},
        "sizes": ["512x768", 256, {"size": "128x64", "weight": 3}],
    }])
    [c] = spec.classes
    assert [(s.width, s.height, s.weight) for s in c.sizes] == [(512, 768, 1), (256, 256, 1), (128, 64, 3)]
    assert c.steps.values == (20, 21, 22)


@pytest.mark.parametrize("changes, message", [
    ({"arrival": {"process": "poisson", "rate": 0}}, "arrival.poisson.rate"),
    ({"arrival": {"process": "gamma", "rate": 1}}, "cv"),
    ({"arrival": {"process": "zipf", "rate": 1}}, "arrival"),
    ({"arrival": {"process": "poisson", "rate": 1, "burst": 2}}, "Extra inputs"),
    ({"num_requests": None}, "duration_s or num_requests"),
    ({"classes": []}, "classes"),
    ({"classes": [{"name": "a", "model": "sd", "sizes": ["64x64"], "steps": [0]}]}, "positive"),
    ({"classes": [{"name": "a", "model": "sd", "sizes": ["60x64"], "steps": 10}]}, "multiples of 8"),
    ({"classes": [{"name": "a", "model": "sd", "sizes": ["big"], "steps": 10}]}, "512x768"),
    ({"classes": [{"name": "a", "model": "sd", "sizes": [64], "steps": {"min": 5}}]}, "steps"),
    ({"classes": [{"name": "a", "sizes": [64], "steps": 5}, {"name": "a", "sizes": [64], "steps": 5}]}, "unique"),
    ({"slo_scale": -1}, "slo_scale"),
    ({"colour": "red"}, "colour"),
])
def test_invalid_specs_say_what_is_wrong(changes, message):
    with pytest.raises(WorkloadError, match=message):
        spec_with(**changes)


def test_trace_errors(tmp_path):
    (tmp_path / "bad.csv").write_text("offset_s,color\n0,red\n")
    with pytest.raises(WorkloadError, match="unknown trace column"):
        parse_workload({**BASE, "arrival": {"process": "trace", "path": "bad.csv"}}, tmp_path)
    (tmp_path / "back.csv").write_text("offset_s\n1.0\n0.5\n")
    with pytest.raises(WorkloadError, match="must not decrease"):
        parse_workload({**BASE, "arrival": {"process": "trace", "path": "back.csv"}}, tmp_path)
    with pytest.raises(WorkloadError, match="no trace file"):
        parse_workload({**BASE, "arrival": {"process": "trace", "path": "missing.csv"}}, tmp_path)


# -- arrivals ----------------------------------------------------------------------------------

def gaps(requests):
    return [b.offset_s - a.offset_s for a, b in zip(requests, requests[1:])]


def test_deterministic_by_seed_and_mix_independent_of_rate():
    spec = spec_with()
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(replace(spec, seed=4))
    slow, fast = generate(spec), generate(spec.with_rate(40))
    # Same requests, ten times closer together: a load sweep compares like with like.
    assert [(r.num_inference_steps, r.seed) for r in slow] == [(r.num_inference_steps, r.seed) for r in fast]
    assert fast[-1].offset_s < slow[-1].offset_s / 5


def test_poisson_rate_and_gap_spread():
    requests = generate(spec_with(num_requests=8000, arrival={"process": "poisson", "rate": 8}))
    g = gaps(requests)
    assert statistics.mean(g) == pytest.approx(1 / 8, rel=0.04)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.06)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_rate_and_burstiness(cv):
    requests = generate(spec_with(num_requests=8000, arrival={"process": "gamma", "rate": 8, "cv": cv}))
    g = gaps(requests)
    assert statistics.mean(g) == pytest.approx(1 / 8, rel=0.08)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(cv, rel=0.1)


def test_burst_phase():
    spec = spec_with(num_requests=None, duration_s=600, arrival={
        "process": "burst", "base_rate": 2, "burst_rate": 20, "burst_start_s": 200, "burst_duration_s": 100})
    offsets = [r.offset_s for r in generate(spec)]
    inside = [o for o in offsets if 200 <= o < 300]
    before = [o for o in offsets if o < 200]
    # Expected 2000 in the burst (sd ~45), 400 before it (sd 20), 1000 outside in all.
    assert 1800 < len(inside) < 2200
    assert 320 < len(before) < 480
    assert len(offsets) - len(inside) == pytest.approx(1000, abs=130)
    assert spec.mean_rate == pytest.approx((2 * 500 + 20 * 100) / 600)
    doubled = spec.with_rate(2 * spec.mean_rate).arrival
    assert isinstance(doubled, BurstArrivals) and (doubled.base_rate, doubled.burst_rate) == (4, 40)


def test_burst_with_a_count_ends_after_the_burst_when_the_base_rate_is_zero():
    spec = spec_with(num_requests=10_000, arrival={
        "process": "burst", "base_rate": 0, "burst_rate": 10, "burst_start_s": 5, "burst_duration_s": 10})
    offsets = [r.offset_s for r in generate(spec)]
    assert 60 < len(offsets) < 140 and all(5 <= o < 15 for o in offsets)


def test_trace_replay_with_fields_and_time_scale(tmp_path):
    (tmp_path / "t.csv").write_text(
        "offset_s,size,steps,guidance_scale,model,slo_s\n"
        "0.5,128x64,7,,,\n"
        "1.0,,,1.0,other,9.5\n"
        "2.0,,,,,\n"
    )
    raw = {**BASE, "num_requests": None, "slo_scale": 2,
           "arrival": {"process": "trace", "path": "t.csv", "time_scale": 2.0}}
    spec = parse_workload(raw, tmp_path)
    cost = ConstantCost(step_s=1.0, encode_s=0.0, decode_s=0.0)
    first, second, third = generate(spec, cost)
    assert [first.offset_s, second.offset_s, third.offset_s] == [1.0, 2.0, 4.0]
    assert (first.width, first.height, first.num_inference_steps) == (128, 64, 7)
    assert first.slo_s == pytest.approx(2 * 7)  # σ × solo (7 rounds of 1 s)
    assert (second.guidance_scale, second.model, second.slo_s) == (1.0, "other", 9.5)
    assert (third.width, third.model) == (64, "sd") and third.num_inference_steps in (10, 20)
    # The mix draws stay aligned with the rows whether or not the trace fixes a field.
    plain = generate(parse_workload({**raw, "arrival": {"process": "trace", "path": "t.csv"}}, tmp_path))
    assert [r.seed for r in plain] == [first.seed, second.seed, third.seed]
    assert spec.mean_rate == pytest.approx(3 / 4.0)
    assert [r.offset_s for r in generate(spec.with_rate(1.5))] == pytest.approx([0.5, 1.0, 2.0])


def test_duration_and_count_both_bound_the_run():
    assert len(generate(spec_with(num_requests=5, duration_s=1000))) == 5
    requests = generate(spec_with(num_requests=10_000, duration_s=10))
    assert requests[-1].offset_s < 10 and 20 < len(requests) < 70


# -- the mix and SLOs --------------------------------------------------------------------------

def test_class_and_size_weights():
    spec = spec_with(num_requests=6000, classes=[
        {"name": "big", "model": "sd", "weight": 1, "sizes": [{"size": 128, "weight": 1}, {"size": 256, "weight": 2}],
         "steps": 30, "guidance_scale": 1.0},
        {"name": "small", "model": "sd", "weight": 2, "sizes": [64], "steps": [10, 20]},
    ])
    requests = generate(spec)
    classes = Counter(r.request_class for r in requests)
    assert classes["small"] / len(requests) == pytest.approx(2 / 3, abs=0.03)
    big = Counter(r.width for r in requests if r.request_class == "big")
    assert big[256] / (big[128] + big[256]) == pytest.approx(2 / 3, abs=0.04)
    assert all(not r.uses_cfg and r.num_inference_steps == 30 for r in requests if r.request_class == "big")
    assert all(r.uses_cfg for r in requests if r.request_class == "small")


def test_slo_is_sigma_times_solo_latency_and_classes_can_override_sigma():
    cost = BatchingCost()
    spec = spec_with(slo_scale=5, classes=[
        {"name": "a", "model": "sd", "sizes": [64], "steps": [10, 20]},
        {"name": "tight", "model": "sd", "sizes": [128], "steps": 10, "guidance_scale": 1.0, "slo_scale": 2},
    ])
    requests = generate(spec, cost)
    for r in requests:
        sigma = 2 if r.request_class == "tight" else 5
        solo = cost.solo_seconds("sd", r.height, r.width, r.num_inference_steps, r.uses_cfg)
        assert r.slo_s == pytest.approx(sigma * solo)
    # Without a cost model the SLO is unknown, not wrong.
    assert all(r.slo_s is None for r in generate(spec))


def test_unique_prompts_and_bodies():
    spec = spec_with(classes=[{"name": "a", "model": "sd", "sizes": [64], "steps": 10, "unique_prompts": True,
                               "prompt": "cat", "negative_prompt": "blurry"}])
    requests = generate(spec)
    assert len({r.prompt for r in requests}) == len(requests)
    body = requests[0].body()
    assert body["model"] == "sd" and body["negative_prompt"] == "blurry" and body["size"] == "64x64"


def test_poisson_workload_is_a_one_class_spec():
    old = PoissonWorkload(rate=5.0, num_requests=50, seed=9, width=96, height=64)
    assert generate(old) == generate(old.to_spec())
    assert "model" not in generate(old)[0].body()  # the server's default model, as before


def test_yaml_round_trip_of_a_file(tmp_path):
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(BASE))
    spec = load_workload(tmp_path / "w.yaml")
    assert spec.name == "w" and spec.seed == 3 and isinstance(spec.arrival, PoissonArrivals)
    (tmp_path / "broken.yaml").write_text("arrival: [unclosed")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(tmp_path / "broken.yaml")
    assert isinstance(GammaArrivals(1.0, 2.0).scaled(2.0), GammaArrivals)
    assert Path(WORKLOADS_DIR).is_dir()
