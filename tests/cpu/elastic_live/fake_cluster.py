"""Ray's fake multi-node autoscaling cluster on this machine, for one scenario process.

`ray.cluster_utils.AutoscalingCluster` is what Ray's own tests use, but it runs `ray stop
--force` (every Ray on the machine, not only its own) and reads a config its wheel does not ship.
This starts the same thing itself: a head (`ray start --head --block`) whose autoscaler uses
Ray's `fake_multinode` provider, which starts each node it launches as raylet processes here.
The cluster has a token of its own (Ray's token auth, as every stepserve cluster); a process
that connects must have `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN` in its environment before it
imports Ray, so a scenario runs in a process of its own. On exit, the head's process group and
every process that names this cluster's GCS address (the fake nodes) are ended, by PID."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

SCAFFOLD = {  # what the autoscaler's schema asks of every cluster config; nothing here uses it
    "auth": {}, "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
    "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fake_cluster(head_cpus: float, node_resources: dict[str, float], max_nodes: int,
                 idle_timeout_s: float = 6.0) -> Iterator[str]:
    """Yields the cluster's address. `node_resources`: what each node the autoscaler may launch
    has (one node type, up to `max_nodes` of it); the head has `head_cpus` and no more."""
    from ray._private.services import get_node_ip_address

    if os.environ.get("RAY_AUTH_MODE") != "token" or not os.environ.get("RAY_AUTH_TOKEN"):
        raise RuntimeError("set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN before importing ray")
    port, ip = free_port(), get_node_ip_address()
    address = f"{ip}:{port}"
    config = {
        "cluster_name": f"fake-{port}", "max_workers": max_nodes, "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            "worker": {"resources": node_resources, "node_config": {}, "min_workers": 0, "max_workers": max_nodes},
        },
        **SCAFFOLD,
    }
    folder = Path(tempfile.mkdtemp(prefix="stepserve-fake-cluster-"))
    (folder / "autoscaling.json").write_text(json.dumps(config))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    ray_cli = Path(sys.executable).parent / "ray"
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={port}", f"--num-cpus={head_cpus}",
         "--include-dashboard=false", "--object-store-memory=200000000",
         f"--autoscaling-config={folder / 'autoscaling.json'}"],
        env=env, start_new_session=True, stdout=open(folder / "head.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _listening(ip, port):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake cluster's head did not start: {(folder / 'head.log').read_text()}")
            time.sleep(0.5)
        yield address
    finally:
        _end(head, address)


def _listening(ip: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1):
        return True
    return False


def _end(head: subprocess.Popen, address: str) -> None:
    """The fake nodes first (their processes name the GCS address), then the head's group."""
    mine = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if f"--gcs-address={address}" in cmdline or f"-Dray.address={address}" in cmdline:
            mine.append(proc)
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=30)
    psutil.wait_procs(mine, timeout=30)
