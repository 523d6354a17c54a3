"""sim_vs_live without a live app: images and videos compared apart, the profile commands, and
the live config and simulated requests it derives from a Serve config. Hand-made records; the
live comparison itself is the slow test in test_sim_vs_live.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stepserve.load_tests import sim_vs_live as svl
from stepserve.load_tests.metrics import percentile
from stepserve.load_tests.plots import plot_sim_vs_live
from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.sweep import sim_config_from_serve
from stepserve.load_tests.workload import ScheduledRequest, generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.runtime import load_serve_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LOCAL, LOCAL_VIDEO = CONFIGS / "local-tiny.yaml", CONFIGS / "local-video.yaml"


def scheduled(index: int, video: bool) -> ScheduledRequest:
    return ScheduledRequest(index=index, offset_s=0.1 * index, num_inference_steps=10, seed=index, width=64,
                            height=64, guidance_scale=5.0 if video else 7.5, prompt="p",
                            model="tiny-wan" if video else "tiny-sd", num_frames=9 if video else None,
                            request_class="video" if video else "image", slo_s=3.0)


def record(index: int, latency: float | None, status: int | None = 200) -> RequestRecord:
    return RequestRecord(index=index, steps=10, scheduled_s=0.1 * index, sent_s=0.1 * index, latency_s=latency,
                         status=status, slo_s=3.0)


def comparison(requests, live, sim, policy="genserve"):
    return svl.make_comparison(policy, 2.0, requests, live, sim, {"w0": 1.0, "w1": 1.0}, {})


def mixed(images: int, videos: int):
    """Images first (index 0..), then videos; image latencies 1.0..1.9 s, videos 0.5 s."""
    requests = [scheduled(i, False) for i in range(images)] + [scheduled(images + i, True) for i in range(videos)]
    live = [record(i, 1.0 + 0.1 * (i % 10)) for i in range(images)] + [
        record(images + i, 0.5) for i in range(videos)]
    return requests, live


def test_images_and_videos_are_summarized_apart():
    requests, live = mixed(images=30, videos=25)
    # The simulator 10% slow on images, 20% fast on videos.
    sim = [replace(r, latency_s=r.latency_s * (1.1 if r.index < 30 else 0.8)) for r in live]
    c = comparison(requests, live, sim)
    assert list(c.kinds) == ["image", "video"]
    live_image, sim_image = c.summaries("image")
    assert (live_image.count, sim_image.count, c.kinds["video"][0].count) == (30, 30, 25)
    assert live_image.latency_p95_s == pytest.approx(percentile([r.latency_s for r in live[:30]], 95))
    assert c.error("latency_p50_s", "image") == pytest.approx(0.1)
    assert c.error("latency_p95_s", "video") == pytest.approx(-0.2)
    assert c.summaries() == (c.live, c.sim) and c.live.count == 55
    # Per-kind summaries carry no busy fraction (the workers are shared); the run's does.
    assert live_image.busy_fraction is None and c.sim.busy_fraction is not None
    assert c.held() == [None, "image", "video"]
    assert not c.within(0.15, "video") and c.within(0.15, "image")
    assert not c.agrees(0.15)  # the videos are held to the bar, and miss it
    assert c.agrees(0.25)


def test_a_kind_with_too_few_requests_is_reported_but_not_held():
    # Five videos, all fast, simulated 60% slow: they sit below every image, so the run's own
    # P50 and P95 (images) agree exactly.
    requests, live = mixed(images=40, videos=5)
    sim = [replace(r, latency_s=0.8) if r.index >= 40 else r for r in live]
    c = comparison(requests, live, sim)
    assert c.error("latency_p50_s") == 0 and c.error("latency_p95_s") == 0
    assert c.error("latency_p50_s", "video") == pytest.approx(0.6)
    assert c.held(20) == [None, "image"] and c.agrees(0.15, 20)
    assert c.held(5) == [None, "image", "video"] and not c.agrees(0.15, 5)


def test_a_live_failure_or_a_kind_the_simulator_never_finished_disagrees():
    requests, live = mixed(images=30, videos=25)
    failed = [record(0, None, status=500)] + live[1:]
    assert not comparison(requests, failed, live).agrees(0.15)
    rejected = [replace(r, latency_s=None, status=429) if r.index >= 30 else r for r in live]
    c = comparison(requests, live, rejected)
    assert c.error("latency_p50_s", "video") is None and not c.within(0.15, "video") and not c.agrees(0.15)


def test_an_image_only_run_is_compared_as_before():
    requests = [scheduled(i, False) for i in range(30)]
    live = [record(i, 1.0 + 0.01 * i) for i in range(30)]
    sim = [replace(r, latency_s=r.latency_s * 1.05) for r in live]
    c = comparison(requests, live, sim, policy="continuous")
    assert c.kinds == {} and c.held() == [None]
    assert c.error("latency_p95_s") == pytest.approx(0.05) and c.agrees(0.15)
    panels, errors = svl.plot_panels([c])
    assert list(panels) == ["continuous @ 2 req/s"] and set(panels["continuous @ 2 req/s"]) == {"live", "simulated"}
    assert [name for name, _, _ in errors] == ["continuous @ 2"]


def test_table_json_and_plot_name_the_kinds(capsys, tmp_path):
    requests, live = mixed(images=40, videos=5)
    sim = [replace(r, latency_s=0.8) if r.index >= 40 else r for r in live]
    c = comparison(requests, live, sim)
    svl.print_table([c], 0.15, 20)
    lines = capsys.readouterr().out.splitlines()
    [run] = [line for line in lines if line.startswith("genserve")]
    [image] = [line for line in lines if line.startswith("  image")]
    [video] = [line for line in lines if line.startswith("  video")]
    assert run.endswith("yes") and image.endswith("yes") and video.endswith("not held (5 ok < 20)")
    assert "+60.0%" in video and " 40/40" in image

    report = json.loads(json.dumps(svl.run_report(c, 0.15, 20)))  # JSON-ready
    assert report["agrees"] and report["held"] == ["all", "image"]
    assert report["kinds"]["video"]["held"] is False and report["kinds"]["video"]["within"] is False
    assert report["kinds"]["video"]["error"]["latency_p50_s"] == pytest.approx(0.6)
    assert report["kinds"]["image"]["live"]["count"] == 40
    assert {r["kind"] for r in report["live_records"]} == {"image", "video"}
    assert report["sim_records"][44]["kind"] == "video"

    panels, errors = svl.plot_panels([c])
    assert set(panels["genserve @ 2 req/s"]) == {"live image", "simulated image", "live video", "simulated video"}
    assert panels["genserve @ 2 req/s"]["simulated video"] == [0.8] * 5
    assert [name for name, _, _ in errors] == ["genserve @ 2", "genserve @ 2 image", "genserve @ 2 video"]
    plot_sim_vs_live(panels, errors, 0.15, "hand-made", tmp_path / "sim_vs_live.png")
    assert (tmp_path / "sim_vs_live.png").stat().st_size > 0


def test_the_profile_is_measured_for_every_model_the_requests_use(tmp_path):
    requests = generate(load_workload("local-video-tiny"))
    commands = svl.profile_commands(LOCAL_VIDEO, tmp_path, requests)
    assert [path for _, path in commands] == [tmp_path / "profile-tiny-sd.csv", tmp_path / "profile-tiny-wan.csv"]
    for (command, path), model in zip(commands, ("tiny-sd", "tiny-wan")):
        line = " ".join(command[2:])
        assert line == (f"stepserve.cli profile --model {model} --device cpu --config {LOCAL_VIDEO} --sizes 64 "
                        f"--out {path}")
    # Its 9 frames are on the profiler's CPU grid; other counts are interpolated, and said so.
    from stepserve.profiling.video import GRIDS

    assert svl.frame_notes(requests, GRIDS["cpu"].frames) == []
    [note] = svl.frame_notes([replace(r, num_frames=17) if r.is_video else r for r in requests], (5, 9))
    assert "tiny-wan" in note and "[17]" in note
    # An image-only workload measures what it did before: its one model at its sizes.
    [(command, _)] = svl.profile_commands(LOCAL, tmp_path, generate(load_workload("local-tiny")))
    assert command[command.index("--model") + 1] == "tiny-sd" and command[command.index("--sizes") + 1:][:2] == [
        "64", "--out"]


def test_the_live_router_predicts_with_the_comparisons_profile(tmp_path):
    video = load_serve_config(LOCAL_VIDEO)
    measured = tmp_path / "profile-tiny-wan.csv"
    config = svl.live_serve_config(video, ["tiny-sd-cpu", str(measured)])
    router = config["applications"][0]["args"]["router"]
    assert router["profiles"] == [str(CONFIGS / "profiles" / "tiny-sd-cpu.csv"), str(measured)]
    assert video["applications"][0]["args"]["router"]["profiles"] == ["tiny-sd-cpu", "tiny-wan-cpu"]  # not changed
    # A config that names no profiles (the image-only comparison's) is deployed as it is.
    local = load_serve_config(LOCAL)
    assert svl.live_serve_config(local, ["tiny-sd-cpu"]) == local


def test_the_simulator_gets_the_live_routers_policy_options_and_deadlines():
    options, slos = svl.served_policy(load_serve_config(LOCAL_VIDEO), "composed")
    assert options == {"sp_degrees": (1, 2), "refuse_unattainable": False, "image_max_batch": 8,
                       "pack_resolutions": False}
    # Swapped for a baseline, the config keeps the options that policy takes: the spine's.
    assert svl.served_policy(load_serve_config(LOCAL_VIDEO), "genserve")[0] == {
        "sp_degrees": (1, 2), "image_max_batch": 8, "pack_resolutions": False}
    assert slos == {"tiny-sd": 2.0, "tiny-wan": 600.0}
    assert svl.served_policy(load_serve_config(LOCAL), "continuous") == ({}, {"tiny-sd": None})
    with pytest.raises(ValueError, match="profiles"):
        svl.served_policy(load_serve_config(LOCAL), "genserve")  # as the deployment would refuse it

    requests = [scheduled(0, False), scheduled(1, True)]
    served = svl.as_served(requests, slos)
    assert [r.slo_s for r in served] == [2.0, 600.0] and [r.slo_s for r in requests] == [3.0, 3.0]
    records = [record(0, 1.0), record(1, 1.0)]
    assert [r.slo_s for r in svl.with_workload_slos([replace(r, slo_s=9.0) for r in records], requests)] == [3.0, 3.0]


def test_the_simulated_twin_of_the_video_workload_runs_and_compares():
    # What compare() simulates, on the shipped profiles and 20 s of the workload: both kinds
    # finish, and a run compared with itself agrees exactly.
    cost = load_profile("tiny-sd-cpu", "tiny-wan-cpu")
    spec = replace(load_workload("local-video-tiny"), duration_s=20)
    requests = generate(spec, cost)
    options, slos = svl.served_policy(load_serve_config(LOCAL_VIDEO), "composed")
    config = replace(SimConfig(**{**sim_config_from_serve(LOCAL_VIDEO), "host_cpus": 2}), policy="composed",
                     policy_options=options)
    result = simulate(svl.as_served(requests, slos), cost, config)
    records = svl.with_workload_slos(result.records(), requests)
    assert [r.slo_s for r in records] == [r.slo_s for r in requests]
    c = svl.make_comparison("composed", spec.mean_rate, requests, records, records, result.busy_s, {})
    assert set(c.kinds) == {"image", "video"} and all(live.ok == live.count for live, _ in c.kinds.values())
    assert c.kinds["video"][0].count == sum(r.is_video for r in requests) > 0
    assert c.agrees(0.0, min_requests=1)
    # Its router stages, cut as the live router's stage histogram cuts them, add up to each
    # request's time from submit to stored; a video decodes on its worker, inside its last plan.
    for kind in ("image", "video"):
        done = [t for t in result.traces if t.kind == kind]
        stages = result.stage_means(kind)
        total = sum(stages[s] for s in ("text_encode", "queue", "denoise", "decode"))
        assert total == pytest.approx(sum(t.stored_s - t.submit_s for t in done) / len(done))
        assert stages["step"] == pytest.approx(sum((t.finish_s - t.admit_s) / t.steps for t in done) / len(done))
    assert result.stage_means("video")["decode"] == 0.0 < result.stage_means("image")["decode"]
    # Paired with what the live router served (its keys carry the "router." prefix).
    pairs = svl.stage_pairs({"image": {"router.queue": 0.25}}, result.stage_means)
    assert list(pairs) == ["image"] and list(pairs["image"]) == ["text_encode", "queue", "denoise", "step", "decode"]
    assert pairs["image"]["queue"] == (0.25, result.stage_means("image")["queue"])
    assert pairs["image"]["decode"][0] is None


def test_live_repeats_are_held_to_the_bar_by_their_medians(capsys, tmp_path):
    # Three live runs of the same 30 images, 0.8x, 1.0x and 1.3x the simulated latencies: each
    # run alone misses the bar at 15% but one, their median is the simulator's to the digit.
    requests = [scheduled(i, False) for i in range(30)]
    sim = [record(i, 1.0 + 0.01 * i) for i in range(30)]
    runs = [comparison(requests, [replace(r, latency_s=r.latency_s * f) for r in sim], sim, policy="continuous")
            for f in (0.8, 1.0, 1.3)]
    assert [r.agrees(0.15) for r in runs] == [False, True, False]
    c = svl.median_of(runs)
    assert c.repeats == tuple(runs) and c.live.latency_p50_s == runs[1].live.latency_p50_s
    assert c.error("latency_p50_s") == pytest.approx(0) and c.agrees(0.15)
    assert len(c.live_records) == 90 and c.sim == runs[0].sim
    assert svl.median_of(runs[:1]) is runs[0]  # one run is its own comparison

    # A failure in any run is kept: the median of the others does not hide it.
    failed = comparison(requests, [record(0, None, status=500)] + sim[1:], sim, policy="continuous")
    assert not svl.median_of([runs[1], runs[1], failed]).agrees(0.15)

    svl.print_table([c], 0.15)
    lines = capsys.readouterr().out.splitlines()
    [verdict] = [line for line in lines if line.startswith("continuous")]
    assert verdict.endswith("yes") and "+0.0%" in verdict
    assert [line.split()[:2] for line in lines if line.startswith("  run")] == [["run", "1"], ["run", "2"], ["run", "3"]]
    report = json.loads(json.dumps(svl.run_report(c, 0.15)))
    assert report["agrees"] and [r["agrees"] for r in report["repeats"]] == [False, True, False]
    assert report["live_records"] == [] and len(report["repeats"][2]["live_records"]) == 30
    assert "sim_records" not in report["repeats"][0] and len(report["sim_records"]) == 30
    panels, _ = svl.plot_panels([c])
    assert set(panels["continuous @ 2 req/s"]) == {"live (3 runs)", "simulated"}
