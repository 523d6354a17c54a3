"""Starting stepserve in this process: a lean local Ray, then a Serve YAML's application."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_BUILDER = "stepserve.deployments.app:build_app"


def config_path(name: str) -> Path:
    """configs/<name> from a checkout, else the copy installed with the package."""
    checkout = CONFIGS / name
    if checkout.exists():
        return checkout
    from importlib.resources import files

    return Path(str(files("stepserve.configs") / name))


def default_config_path() -> Path:
    """The embedded default, configs/local.yaml: the shapes models trained here, on CPU."""
    return config_path("local.yaml")


def tiny_config_path() -> Path:
    """configs/local-tiny.yaml: tiny-sd with random weights, what the CPU benchmarks and most live
    tests run (its cost profile, configs/profiles/tiny-sd-cpu.csv, was measured on it)."""
    return config_path("local-tiny.yaml")


def load_serve_config(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as f:
        config = yaml.safe_load(f)
    apps = config.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"{path}: expected exactly one application, found {len(apps)}")
    return config


def start_local_ray(num_cpus: int | None = None, object_store_mb: int = 256) -> None:
    """A Ray head in this process without the dashboard (it alone takes ~3 GB)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(
        address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
        object_store_memory=object_store_mb << 20, namespace="serve", log_to_driver=False,
    )


def run_app(config: dict[str, Any], http: bool = True):
    """Deploy the config's application on the running Ray; returns the ingress handle."""
    from ray import serve

    app = config["applications"][0]
    # The builder the YAML names, as `serve run` would import it (stepserve's by default).
    module, _, attr = app.get("import_path", DEFAULT_BUILDER).partition(":")
    builder = getattr(importlib.import_module(module), attr)
    # Serve keeps the proxy options of its first start in this Ray; later calls only warn.
    if http:
        serve.start(proxy_location=config.get("proxy_location", "HeadOnly"), http_options=config.get("http_options"))
    else:
        serve.start(proxy_location="Disabled")
    return serve.run(builder(app.get("args", {})), name=app.get("name", "stepserve"),
                     route_prefix=app.get("route_prefix", "/"))
