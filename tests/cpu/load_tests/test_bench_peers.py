"""The peers benchmark's bookkeeping: naming Ray processes, and reading capacity off the runs."""

from __future__ import annotations

from stepserve.load_tests.bench_peers import _title, capacity_at


def test_a_ray_process_is_named_by_its_actor_or_its_program():
    assert _title(b"ray::ServeReplica:stepserve:Router.handle_request_with_rejection\0\0") == \
        "ray::ServeReplica:stepserve:Router"
    assert _title(b"ray::IDLE\0") == "ray::IDLE"
    assert _title(b"/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet\0--raylet_socket_name=x\0") == \
        "raylet"
    assert _title(b"/venv/bin/python\0-u\0/venv/lib/python3.11/site-packages/ray/_private/log_monitor.py\0") == \
        "log_monitor.py"


def test_capacity_is_the_highest_rate_below_which_every_median_meets_the_slo():
    points = [{"rate": 2, "slo_attainment": 1.0}, {"rate": 2, "slo_attainment": 0.95},
              {"rate": 4, "slo_attainment": 0.92}, {"rate": 4, "slo_attainment": 0.5},
              {"rate": 6, "slo_attainment": 0.99}, {"rate": 6, "slo_attainment": 0.99}]
    assert capacity_at(points) == 2  # 4's median is 0.71; 6 does not count past it
    assert capacity_at(points, slo=0.7) == 6
