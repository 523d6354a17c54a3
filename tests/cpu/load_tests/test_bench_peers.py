"""The peers benchmark's bookkeeping: merging a system's repeats, reading capacity off the runs,
CPU per process."""

from __future__ import annotations

from stepserve.load_tests.bench_peers import capacity_at, cpu_between, merge_runs


def test_capacity_is_the_highest_rate_below_which_every_median_meets_the_slo():
    points = [{"rate": 2, "slo_attainment": 1.0}, {"rate": 2, "slo_attainment": 0.95},
              {"rate": 4, "slo_attainment": 0.92}, {"rate": 4, "slo_attainment": 0.5},
              {"rate": 6, "slo_attainment": 0.99}, {"rate": 6, "slo_attainment": 0.99}]
    assert capacity_at(points) == 2  # 4's median is 0.71; 6 does not count past it
    assert capacity_at(points, slo=0.7) == 6


def test_a_systems_repeats_merge_into_one_result_with_the_median_idle():
    runs = [{"idle_cores": 0.20, "idle_processes": {"a": 0.20}, "points": [{"rate": 2, "repeat": 0}]},
            {"idle_cores": 0.14, "idle_processes": {"a": 0.14}, "points": [{"rate": 2, "repeat": 1}]},
            {"idle_cores": 0.17, "idle_processes": {"a": 0.17}, "points": [{"rate": 2, "repeat": 2}]}]
    merged = merge_runs("stepserve", runs)
    assert merged["system"] == "stepserve" and merged["idle_cores"] == 0.17 and merged["idle_processes"] == {"a": 0.17}
    assert merged["idle_cores_runs"] == [0.20, 0.14, 0.17]
    assert [p["repeat"] for p in merged["points"]] == [0, 1, 2]


def test_cpu_between_two_readings_sums_a_title_and_leaves_out_a_process_that_started_meanwhile():
    before = {1: ("ray::DenoiserWorker", 10.0), 2: ("ray::DenoiserWorker", 20.0), 3: ("raylet", 5.0)}
    after = {1: ("ray::DenoiserWorker", 11.5), 2: ("ray::DenoiserWorker", 21.0), 3: ("raylet", 5.25),
             4: ("ray::ServeReplica:stepserve:Router", 3.0)}
    assert cpu_between(before, after) == {"ray::DenoiserWorker": 2.5, "raylet": 0.25}
    assert list(cpu_between(before, after)) == ["ray::DenoiserWorker", "raylet"]  # largest first
