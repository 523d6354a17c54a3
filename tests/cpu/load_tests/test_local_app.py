"""The benchmark's Serve config: only the port and the policy may differ from the base."""

from __future__ import annotations

import copy

from stepserve.load_tests.local_app import bench_serve_config
from stepserve.runtime import tiny_config_path, load_serve_config


def test_only_policy_and_port_change_and_the_base_is_untouched():
    base = load_serve_config(tiny_config_path())
    pristine = copy.deepcopy(base)
    config = bench_serve_config(base, 43210, "static_fcfs")
    assert base == pristine
    assert config["http_options"] == {**base["http_options"], "host": "127.0.0.1", "port": 43210}
    args, base_args = config["applications"][0]["args"], base["applications"][0]["args"]
    assert args["router"] == {**base_args["router"], "policy": "static_fcfs"}
    assert {k: v for k, v in args.items() if k != "router"} == {k: v for k, v in base_args.items() if k != "router"}
    assert {k: v for k, v in config.items() if k not in ("applications", "http_options")} == \
        {k: v for k, v in base.items() if k not in ("applications", "http_options")}


def test_without_a_policy_the_app_is_the_base_app():
    base = load_serve_config(tiny_config_path())
    assert bench_serve_config(base, 43210)["applications"] == base["applications"]
