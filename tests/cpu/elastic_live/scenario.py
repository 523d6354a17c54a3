"""The elastic pool, live: stepserve on Ray's fake multi-node autoscaling cluster (`fake_cluster`),
each denoiser worker needing a node of its own, which Ray's autoscaler launches on demand.

A burst grows the pool (the router starts workers, their nodes come up), a trickle of requests
follows while the pool shrinks (a draining worker hands its request back at a step boundary),
and then the lull shrinks it to its minimum, and Ray reclaims the idle nodes. Every request must
get its image. Run as `python -m tests.cpu.elastic_live.scenario OUT.json` in a process of its
own (see `fake_cluster`); it writes what it saw there."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

from tests.cpu.elastic_live.fake_cluster import fake_cluster, free_port

BURST = 16
STEPS = 80
TRICKLE_S = 20.0
WORKERS = {"num_workers": 1, "max_batch_size": 2, "num_cpus": 0, "resources": {"stepserve_worker": 1},
           "device": "cpu", "torch_threads": 1,
           "autoscaling": {"min_workers": 1, "max_workers": 3, "target_requests": 2.0, "scale_down_delay_s": 4.0}}


def image(seed: int) -> dict:
    return {"model": "tiny-sd", "prompt": "a red fox", "size": "64x64", "num_inference_steps": STEPS, "seed": seed}


async def scenario(url: str, router, started: float) -> dict:
    import ray

    timeline = []

    async def watch() -> None:
        while True:
            state = await router.readiness.remote()
            nodes = sum(n["Alive"] for n in ray.nodes())
            timeline.append({"t": round(time.monotonic() - started, 2), "nodes": nodes, **state})
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        burst = await asyncio.gather(*(client.post("/v1/images/generations", json=image(i)) for i in range(BURST)))
        burst_end = time.monotonic() - started
        trickle = []
        until = time.monotonic() + TRICKLE_S
        while time.monotonic() < until:
            trickle.append(await client.post("/v1/images/generations", json=image(1000 + len(trickle))))
        deadline = time.monotonic() + 90
        while not (timeline and timeline[-1]["workers"] == 1 and timeline[-1]["nodes"] == 2):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        metrics = (await client.get("/metrics")).text
    watcher.cancel()
    changes = {}
    for line in metrics.splitlines():
        if line.startswith("stepserve_pool_changes_total{"):
            changes[line.split('"')[1]] = float(line.split()[-1])
    return {"burst": [r.status_code for r in burst], "trickle": [r.status_code for r in trickle],
            "errors": [r.text[:300] for r in burst + trickle if r.status_code != 200], "burst_end_s": burst_end,
            "timeline": timeline, "changes": changes}


def main(out: str) -> None:
    started = time.monotonic()
    # The head: Serve's controller and proxy, the ingress, router and job store; every worker
    # needs a node with `stepserve_worker`.
    with fake_cluster(head_cpus=2, node_resources={"CPU": 1, "stepserve_worker": 1}, max_nodes=3) as address:
        import ray
        from ray import serve

        from stepserve.deployments.app import build_app
        from stepserve.runtime import load_serve_config, tiny_config_path

        ray.init(address=address, namespace="serve", log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        (app,) = load_serve_config(tiny_config_path())["applications"]
        args = {**app["args"], "workers": WORKERS, "controlnets": [], "loras": []}
        serve.run(build_app(args), name="stepserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the app never became ready"
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        router = serve.get_deployment_handle("Router", app_name="stepserve")
        result = asyncio.run(scenario(url, router, started))
        result["ready_s"] = ready_s
        serve.shutdown()
        ray.shutdown()
    result["wall_s"] = time.monotonic() - started
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
