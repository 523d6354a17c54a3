"""Deploying stepserve on a lean local Ray for a benchmark, and taking it down again."""

from __future__ import annotations

import copy
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray import serve

from stepserve.policies import options_for
from stepserve.runtime import run_app, start_local_ray


def free_port() -> int:
    """A loopback port nobody listens on now (other test runs use the 8000s)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_serve_config(base: dict[str, Any], port: int, policy: str | None = None) -> dict[str, Any]:
    """A copy of a one-app Serve config served on 127.0.0.1:`port`, with `router.policy`
    replaced when given (keeping the options the new policy takes: `served_router`); every other
    argument (workers, batch cap, models) is kept."""
    config = copy.deepcopy(base)
    config["http_options"] = {**(config.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    if policy is not None:
        args = config["applications"][0].setdefault("args", {})
        args["router"] = served_router(args.get("router") or {}, policy)
    return config


def served_router(router: dict[str, Any], policy: str) -> dict[str, Any]:
    """A config's `router` section with `policy` in place of its own: the options stay where the
    policy is the same, else those of them the new policy takes (`options_for`)."""
    if router.get("policy", "continuous") == policy:
        return dict(router)
    swapped = {**router, "policy": policy}
    if "policy_options" in router:
        swapped["policy_options"] = options_for(policy, router["policy_options"])
    return swapped


@contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """A Ray head in this process for the benchmark's lifetime; Serve and Ray end with it."""
    start_local_ray(num_cpus=num_cpus)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def deployed(config: dict[str, Any]) -> Iterator[str]:
    """Run the config's app on the running local Ray; yields its base URL, deletes it after."""
    run_app(config, http=True)
    try:
        http = config["http_options"]
        yield f"http://{http['host']}:{http['port']}"
    finally:
        serve.delete(config["applications"][0].get("name", "stepserve"))


def log(line: str) -> None:
    """A benchmark's progress line: stderr, so stdout keeps only its results."""
    print(line, file=sys.stderr, flush=True)
