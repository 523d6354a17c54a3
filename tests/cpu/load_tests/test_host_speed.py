"""The speed index and a profile moved to the live run's speed (load_tests/host_speed.py), and
how sim_vs_live reports a speed-matched comparison."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stepserve.load_tests import sim_vs_live as svl
from stepserve.load_tests.host_speed import SpeedProbe, scaled_profile
from stepserve.load_tests.metrics import summarize
from stepserve.policies.cost_model import BatchShape, load_profile
from stepserve.runtime import load_serve_config
from tests.cpu.load_tests.test_sim_vs_live_kinds import LOCAL, comparison, record, scheduled

PROFILE = "tiny-sd-cpu"


def test_a_scaled_profile_scales_every_time_and_keeps_the_hosts_shares():
    base, slow = load_profile(PROFILE), scaled_profile([PROFILE], 1.5)
    batch = BatchShape("tiny-sd", 64, 64, 2)
    assert slow.round_seconds([batch]) == pytest.approx(1.5 * base.round_seconds([batch]))
    assert slow.text_encode_seconds("tiny-sd", 2) == pytest.approx(1.5 * base.text_encode_seconds("tiny-sd", 2))
    assert slow.decode_seconds("tiny-sd", 64, 64) == pytest.approx(1.5 * base.decode_seconds("tiny-sd", 64, 64))
    assert slow.solo_seconds("tiny-sd", 64, 64, 20, True) == pytest.approx(
        1.5 * base.solo_seconds("tiny-sd", 64, 64, 20, True))
    assert slow.router_cpu_seconds() == pytest.approx(1.5 * base.router_cpu_seconds())
    # Shares of cores and ratios between probes are not times: unchanged.
    assert slow.host_idle_cores() == pytest.approx(base.host_idle_cores())
    assert slow.host_slowdown(2) == pytest.approx(base.host_slowdown(2))
    with pytest.raises(ValueError, match="> 0"):
        scaled_profile([PROFILE], 0.0)


def test_the_speed_probe_times_the_first_images_forward():
    requests = [scheduled(0, True), scheduled(1, False)]  # a video first: the probe takes the image
    probe = svl.speed_probe(load_serve_config(LOCAL), requests)
    assert isinstance(probe, SpeedProbe)
    probe.repeats = 3
    assert 0 < probe.seconds() < 5
    assert svl.speed_probe(load_serve_config(LOCAL), [scheduled(0, True)]) is None  # no image: no probe


def test_a_run_simulated_at_the_live_speed_is_reported_beside_the_verdict(capsys):
    requests = [scheduled(i, False) for i in range(30)]
    live = [record(i, 1.0 + 0.01 * i) for i in range(30)]
    as_measured = [replace(r, latency_s=r.latency_s * 1.05) for r in live]
    at_live_speed = summarize([replace(r, latency_s=r.latency_s * 1.3) for r in live], None, 2.0)
    c = svl.make_comparison("continuous", 2.0, requests, live, as_measured, None, {}, None, 1.4, at_live_speed)
    assert c.agrees(0.15)  # the verdict stays on the profile as measured
    assert c.error_at_live_speed("latency_p50_s") == pytest.approx(0.3)
    report = json.loads(json.dumps(svl.run_report(c, 0.15)))
    assert report["agrees"] and report["speed_factor"] == 1.4
    assert report["error_at_live_speed"]["latency_p95_s"] == pytest.approx(0.3)
    assert report["sim_at_live_speed"]["count"] == 30
    svl.print_table([c], 0.15)
    assert "1.40x the profile's time" in capsys.readouterr().out
    plain = comparison(requests, live, as_measured, policy="continuous")
    assert plain.speed_factor is None and plain.error_at_live_speed("latency_p50_s") is None


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
