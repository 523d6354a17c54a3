"""A profile moved to another speed and the median of profiles (load_tests/host_speed.py), and
how sim_vs_live fits the simulator's speed to the live runs and reports both."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import pytest

from stepserve.load_tests import sim_vs_live as svl
from stepserve.load_tests.bench_batching import PolicyRun
from stepserve.load_tests.host_speed import scaled_profile
from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.sweep import sim_config_from_serve
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import BatchShape, load_profile, read_profile, resolve_profile
from stepserve.runtime import load_serve_config
from tests.cpu.load_tests.test_sim_vs_live_kinds import LOCAL, LOCAL_VIDEO, comparison, record, scheduled

PROFILE = "tiny-sd-cpu"


def test_a_scaled_profile_moves_what_the_named_models_measured_in_process():
    base, slow = load_profile(PROFILE, "tiny-wan-cpu"), scaled_profile([PROFILE, "tiny-wan-cpu"], {"tiny-sd": 1.5})
    assert slow.text_encode_seconds("tiny-sd", 2) == pytest.approx(1.5 * base.text_encode_seconds("tiny-sd", 2))
    assert slow.decode_seconds("tiny-sd", 64, 64) == pytest.approx(1.5 * base.decode_seconds("tiny-sd", 64, 64))
    # A round: the forward and the runner's bookkeeping scale, the live app's fixed round trip stays.
    fixed = next(r.seconds for r in read_profile(resolve_profile(PROFILE))
                 if (r.component, r.height) == ("round_overhead", 0))
    batch = BatchShape("tiny-sd", 64, 64, 2)
    assert slow.round_seconds([batch]) - fixed == pytest.approx(1.5 * (base.round_seconds([batch]) - fixed))
    # Measured through the live app, or not times at all: unchanged.
    assert slow.request_overhead_seconds("tiny-sd") == pytest.approx(base.request_overhead_seconds("tiny-sd"))
    assert slow.router_cpu_seconds() == pytest.approx(base.router_cpu_seconds())
    assert slow.host_idle_cores() == pytest.approx(base.host_idle_cores())
    assert slow.host_slowdown(2) == pytest.approx(base.host_slowdown(2))
    # A model not named keeps its times.
    video = BatchShape("tiny-wan", 64, 64, 2, frames=9)
    assert slow.round_seconds([video]) == pytest.approx(base.round_seconds([video]))
    with pytest.raises(ValueError, match="> 0"):
        scaled_profile([PROFILE], {"tiny-sd": 0.0})


def test_the_speed_fit_meets_each_kinds_live_step_with_one_factor_per_model():
    # Steps proportional to the factor, but a video's step also slowed by the images' speed
    # (they share the workers): the fit still meets both within 1%.
    calls = []

    def steps(factors):
        calls.append(factors)
        image, video = factors.get("tiny-sd", 1.0), factors.get("tiny-wan", 1.0)
        return {"image": 0.010 * image, "video": 0.020 * video * (0.9 + 0.1 * image)}

    fit = svl.fit_speed({"image": 0.013, "video": 0.030}, {"image": {"tiny-sd"}, "video": {"tiny-wan"}}, steps)
    assert fit.factors["tiny-sd"] == pytest.approx(1.3, rel=0.01)
    assert all(abs(r) <= svl.CALIBRATION_TOLERANCE for r in fit.residuals.values())
    assert fit.simulations == len(calls) <= svl.CALIBRATION_TRIES
    assert calls[0] == {"tiny-sd": 1.0, "tiny-wan": 1.0}  # first: the profile as measured

    # A step that does not follow the factor: the closest try is kept, after every try.
    fit = svl.fit_speed({"image": 0.013}, {"image": {"tiny-sd"}}, lambda f: {"image": 0.010}, tries=3)
    assert fit.simulations == 3 and fit.residuals["image"] == pytest.approx(0.010 / 0.013 - 1)
    # No live step for a kind: its models keep their times.
    assert svl.fit_speed({}, {"image": {"tiny-sd"}}, lambda f: {}).factors == {}
    with pytest.raises(ValueError, match="both"):
        svl.fit_speed({"image": 0.01}, {"image": {"m"}, "video": {"m"}}, lambda f: {})


def test_the_fit_recovers_the_speed_a_run_was_simulated_at():
    # The real simulator: "live" is the video workload's twin on the shipped profiles made 30%
    # slower for images and 20% faster for videos; fitted from the shipped profiles, the
    # simulator finds those speeds again.
    profiles = ["tiny-sd-cpu", "tiny-wan-cpu"]
    spec = replace(load_workload("local-video-tiny"), duration_s=15)
    requests = generate(spec, load_profile(*profiles))
    options, slos = svl.served_policy(load_serve_config(LOCAL_VIDEO), "genserve")
    config = replace(SimConfig(**{**sim_config_from_serve(LOCAL_VIDEO), "host_cpus": 2}), policy="genserve",
                     policy_options=options)
    served = svl.as_served(requests, slos)

    def steps(factors):
        result = simulate(served, scaled_profile(profiles, factors), config)
        return {kind: result.stage_means(kind)["step"] for kind in ("image", "video")}

    fit = svl.fit_speed(steps({"tiny-sd": 1.3, "tiny-wan": 0.8}), svl.models_by_kind(requests), steps)
    assert fit.factors["tiny-sd"] == pytest.approx(1.3, rel=0.05)
    assert fit.factors["tiny-wan"] == pytest.approx(0.8, rel=0.05)
    assert all(abs(r) <= svl.CALIBRATION_TOLERANCE for r in fit.residuals.values())


def test_compare_holds_the_simulator_at_the_live_runs_speed(monkeypatch, tmp_path):
    # The live side is a test double: each "live run" is the simulator itself on the shipped
    # profile made 25% slower (the real live runs are the slow tests in test_sim_vs_live.py).
    # compare() then finds that speed, agrees at it, and reports the profile's own speed beside.
    def live_twin(config, port, policy, warmup, requests, timeout):
        options, slos = svl.served_policy(load_serve_config(LOCAL), policy)
        sim_config = replace(SimConfig(**{**sim_config_from_serve(LOCAL), "host_cpus": 2}), policy=policy,
                             policy_options=options)
        result = simulate(svl.as_served(requests, slos), scaled_profile([PROFILE], {"tiny-sd": 1.25}), sim_config)
        stages = {f"router.{stage}": mean for stage, mean in result.stage_means("image").items()}
        return PolicyRun(svl.with_workload_slos(result.records(), requests), {}, {"image": stages})

    monkeypatch.setattr(svl, "run_policy", live_twin)
    monkeypatch.setattr(svl, "local_ray", lambda cpus: contextlib.nullcontext())
    args = svl.parse_args(["--out", str(tmp_path), "--profile", PROFILE, "--duration", "20", "--repeats", "2",
                           "--policies", "continuous", "static_fcfs"])
    comparisons = svl.compare(args)
    assert [c.policy for c in comparisons] == ["continuous", "static_fcfs"]
    for c in comparisons:
        assert len(c.repeats) == 2 and c.agrees(0.05)
        for run in c.repeats:  # each run's own twin, at the speed fitted to it
            assert run.calibration.factors["tiny-sd"] == pytest.approx(1.25, rel=0.02)
        assert c.as_profiled.error("latency_p50_s") < -0.1  # the profile's own speed is 25% fast
        report = json.loads(json.dumps(svl.run_report(c, 0.15)))
        assert report["calibration"] is None and report["repeats"][0]["calibration"]["factors"]["tiny-sd"] > 1.2
        assert report["sim_records"] == [] and len(report["repeats"][1]["sim_records"]) == c.live.count
    args = svl.parse_args(["--out", str(tmp_path), "--profile", PROFILE, "--duration", "20", "--repeats", "1",
                           "--no-calibrate"])
    [profiled] = svl.compare(args)
    assert profiled.calibration is None and profiled.as_profiled is None  # no fit asked: the profile's speed
    assert profiled.error("latency_p50_s") < -0.1


def test_the_verdict_at_the_fitted_speed_is_reported_with_the_simulator_as_profiled(capsys):
    requests = [scheduled(i, False) for i in range(30)]
    live = [record(i, 1.0 + 0.01 * i) for i in range(30)]
    fitted = comparison(requests, live, [replace(r, latency_s=r.latency_s * 1.05) for r in live], policy="continuous")
    profiled = comparison(requests, live, [replace(r, latency_s=r.latency_s * 1.3) for r in live], policy="continuous")
    c = replace(fitted, as_profiled=profiled)
    assert c.agrees(0.15) and not profiled.agrees(0.15)  # the verdict is on the fitted speed
    report = json.loads(json.dumps(svl.run_report(c, 0.15)))
    assert report["agrees"] and report["error"]["latency_p50_s"] == pytest.approx(0.05)
    assert report["as_profiled"]["error"]["latency_p50_s"] == pytest.approx(0.3)
    assert report["as_profiled"]["sim"]["count"] == 30 and len(report["as_profiled"]["sim_records"]) == 30
    svl.print_table([c], 0.15)
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  as profiled")]
    assert "+30.0%" in row
    panels, _ = svl.plot_panels([c])
    assert set(panels["continuous @ 2 req/s"]) == {"live", "simulated", "simulated as profiled"}
    assert svl.run_report(profiled, 0.15)["as_profiled"] is None
    calibration = svl.Calibration({"tiny-sd": 1.1}, {"image": 0.004}, 2)
    assert "tiny-sd x1.100" in svl.describe(calibration) and "image +0.4%" in svl.describe(calibration)
    assert svl.plot_title("local-tiny", "/out/profile-tiny-sd.csv", True) == (
        "local-tiny: simulated vs live (profile profile-tiny-sd.csv; speed fitted to each live run)")
    assert svl.plot_title("local-tiny", "tiny-sd-cpu", False) == "local-tiny: simulated vs live (profile tiny-sd-cpu)"


def test_the_median_profile_takes_each_points_median_over_the_profiles(tmp_path):
    from stepserve.load_tests.host_speed import median_profile
    from stepserve.policies.cost_model import ProfileRow, read_profile, write_profile

    def row(component, rows, ms, note="measured today"):
        return ProfileRow("m", "cpu", component, 64, 64, rows, 1, ms, 5, note)

    paths = []
    for i, scale in enumerate((1.0, 1.5, 0.8)):
        # round_overhead holds the point (64, 64, rows 8) twice, as the real grid does.
        rows = [row("denoise", 2, 10 * scale), row("round_overhead", 8, 1 * scale), row("round_overhead", 8, 2 * scale)]
        paths.append(tmp_path / f"p{i}.csv")
        write_profile(paths[-1], rows + ([row("denoise", 4, 20)] if i == 0 else []))
    merged = read_profile(median_profile(paths, tmp_path / "median.csv"))
    assert sorted((r.component, r.rows, r.latency_ms) for r in merged) == [
        ("denoise", 2, 10.0), ("denoise", 4, 20.0), ("round_overhead", 8, 1.0), ("round_overhead", 8, 2.0)]
    by_rows = {(r.component, r.rows): r for r in merged}
    assert by_rows["denoise", 2].samples == 15 and by_rows["denoise", 4].samples == 5
    assert by_rows["denoise", 2].source.startswith("median of 3 profiles")
    assert by_rows["denoise", 4].source.startswith("median of 1 ")
    with pytest.raises(ValueError):
        median_profile([], tmp_path / "none.csv")
