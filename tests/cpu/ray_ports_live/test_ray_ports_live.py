"""What a process without the cluster's token gets from the Ray ports a served app leaves listening
beyond loopback (`stepserve serve`'s local Ray, as the tiny default's app runs on it): every RPC
and HTTP control port refuses it (Ray's token auth, which stepserve never turns off); what
answers is only Prometheus text from Ray's read-only metrics endpoints, which Ray serves without
a token by design (a scraper holds none). The SP process groups' store on one node is a file in a
private folder (tests/cpu/actors/test_sp_world.py): it listens on nothing."""

import os

import grpc
import httpx
import psutil
from ray._private.services import get_node_ip_address

from stepserve.runtime import load_serve_config, tiny_config_path

from tests.cpu.integration.conftest import serving

# One method of each gRPC service Ray's processes serve: a server answers UNIMPLEMENTED for the
# services it does not have, and UNAUTHENTICATED, without the token, for the one it has.
METHODS = ("/ray.rpc.NodeInfoGcsService/GetClusterId", "/ray.rpc.NodeManagerService/GetNodeStats",
           "/ray.rpc.CoreWorkerService/NumPendingTasks", "/ray.rpc.ObjectManagerService/Pull",
           "/ray.rpc.ReporterService/ReportOCMetrics", "/ray.rpc.LogService/ListLogs",
           "/ray.serve.ASGIService/HandleRequest")


def listeners() -> list[tuple[int, str, str]]:
    """(port, address, process) of every TCP listener of this process and its children (the local
    Ray: GCS, raylet, agents, workers and replicas) that is not on loopback."""
    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    out = []
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids and not conn.laddr.ip.startswith(("127.", "::1")):
            try:
                name = " ".join(psutil.Process(conn.pid).cmdline()[:2])[-60:]
            except psutil.Error:
                continue
            out.append((conn.laddr.port, conn.laddr.ip, name))
    return out


def answer(host: str, port: int) -> str:
    """'refused' (401/403 over HTTP, UNAUTHENTICATED over gRPC), 'metrics' (Prometheus text),
    or what was answered instead."""
    try:
        response = httpx.get(f"http://{host}:{port}/", timeout=5)
    except httpx.HTTPError:
        response = None  # not HTTP/1: gRPC
    if response is not None:
        if response.status_code in (401, 403):
            return "refused"
        if response.status_code == 200 and "# TYPE " in response.text:
            return "metrics"
        return f"HTTP {response.status_code}"
    codes = set()
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        for method in METHODS:
            call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
            try:
                call(b"", timeout=5)
                codes.add("OK")
            except grpc.RpcError as exc:
                codes.add(exc.code().name)
    return "refused" if "UNAUTHENTICATED" in codes and "OK" not in codes else f"gRPC {sorted(codes)}"


def test_every_ray_port_beyond_loopback_refuses_a_client_without_the_token(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)  # (this process's token: never sent by the probes)
    app = serving(load_serve_config(tiny_config_path()))
    next(app)
    try:
        host = get_node_ip_address()
        found = {port: (address, name, answer(host if address in ("0.0.0.0", "::") else address, port))
                 for port, address, name in listeners()}
    finally:
        app.close()
    assert len(found) >= 8, found  # GCS, raylet, object manager, agents, workers and replicas
    refused = {port for port, (_, _, what) in found.items() if what == "refused"}
    metrics = {port for port, (_, _, what) in found.items() if what == "metrics"}
    assert refused | metrics == set(found), {p: v for p, v in found.items() if p not in refused | metrics}
    assert len(metrics) <= 3, found  # the dashboard head's, the autoscaler monitor's and the agent's exporter
    assert os.environ.get("RAY_AUTH_MODE") != "disabled"
