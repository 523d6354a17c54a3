"""A burst, live: hundreds of image requests at once against an idle app, shed at the edge.

The app from a Serve config (default: configs/local-tiny.yaml) is deployed and warmed up, then
`--requests` generations are sent at once (`raw_burst`: every connection opened first, the
requests written back to back, so the latencies are the server's). What the queues cannot hold
must be answered 429/503 with `Retry-After` by the ingress's admission gate, without a router
round trip, and every request let in must be served. Reported: the answers by status, the
refusal latency as the client saw it (P50/P99/max) and as the ingress measured it (its
`stepserve_http_latency_seconds` for the 429s: from its handler's start), the requests the router
itself had to refuse (`stepserve_requests_total{status="refused"}`: the gate should leave none),
and the floor: the same burst answered 404 by the ingress at once (an unknown model), with the
pool idle and with it busy. No admission rule can answer a burst faster than that floor: it is
what the HTTP proxy and the ingress cost per request on this machine.

    python -m stepserve.load_tests.bench_burst --out docs/results/overload
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stepserve.load_tests.live import loopback_client, wait_ready
from stepserve.load_tests.local_app import bench_serve_config, deployed, free_port, local_ray, log
from stepserve.load_tests.metrics import percentile
from stepserve.load_tests.plots import plot_latency_cdfs
from stepserve.load_tests.raw_burst import BurstAnswer, burst
from stepserve.load_tests.server_metrics import scrape_text
from stepserve.runtime import tiny_config_path, load_serve_config

GENERATIONS = "/v1/images/generations"
REFUSED = (429, 503)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for burst.json and burst.png")
    parser.add_argument("--config", type=Path, default=tiny_config_path(), help="Serve config (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=320, help="requests in the burst (default: %(default)s)")
    parser.add_argument("--size", default="64x64", help="image size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per image (default: %(default)s)")
    parser.add_argument("--busy-steps", type=int, default=100,
                        help="steps of the requests that keep the pool busy for the busy floor (default: %(default)s)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs the local Ray may use")
    return parser.parse_args(argv)


def latencies(answers: list[BurstAnswer], statuses: tuple[int, ...]) -> list[float]:
    return [a.latency_s for a in answers if a.status in statuses]


def spread(values: list[float]) -> dict[str, float | None]:
    """P50, P99 and max in milliseconds."""
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"p50_ms": 1000 * percentile(values, 50), "p99_ms": 1000 * percentile(values, 99),
            "max_ms": 1000 * max(values)}


def samples(exposition: str, name: str, **labels: str) -> dict[str, float]:
    """The samples of metric `name` whose labels include `labels`, by their `le` (histogram
    buckets) or '' (a counter)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                found[sample.labels.get("le", "")] = found.get(sample.labels.get("le", ""), 0.0) + sample.value
    return found


def refusals_in_the_ingress(before: str, after: str) -> dict[str, Any]:
    """The ingress's latency histogram of this run's 429 answers: counts by bucket and the
    bucket bound under which 99% of them were answered."""
    name, labels = "stepserve_http_latency_seconds_bucket", {"route": GENERATIONS, "code": "429"}
    start, end = samples(before, name, **labels), samples(after, name, **labels)
    buckets = {le: end[le] - start.get(le, 0.0) for le in end}
    total = buckets.get("+Inf", 0.0)
    bound = next((float(le) for le, n in sorted(buckets.items(), key=lambda b: float(b[0]))
                  if total and n >= 0.99 * total), None)
    return {"count": total, "p99_at_most_s": bound, "buckets": buckets}


def router_refused(exposition: str) -> float:
    return samples(exposition, "stepserve_requests_total", status="refused").get("", 0.0)


async def floor(url: str, count: int, body: dict[str, Any], busy_steps: int | None) -> list[BurstAnswer]:
    """The same burst for an unknown model (404 in the ingress, before any admission); with
    `busy_steps`, while 16 long requests keep the workers busy."""
    unknown = {**body, "model": "no-such-model"}
    if busy_steps is None:
        return await burst(url, GENERATIONS, unknown, count)
    async with loopback_client(url) as client:
        busy = [asyncio.create_task(client.post(GENERATIONS, json={**body, "num_inference_steps": busy_steps},
                                                timeout=600)) for _ in range(16)]
        await asyncio.sleep(3.0)  # admitted and stepping
        answers = await burst(url, GENERATIONS, unknown, count)
        await asyncio.gather(*busy)
    return answers


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    body = {"prompt": "a red fox in the snow", "size": args.size, "num_inference_steps": args.steps}
    async with loopback_client(url) as client:  # warm: the first request compiles nothing, but loads lazily
        (await client.post(GENERATIONS, json=body, timeout=120)).raise_for_status()
    before = await scrape_text(url)
    log(f"burst: {args.requests} requests at once")
    answers = await burst(url, GENERATIONS, body, args.requests)
    after = await scrape_text(url)
    refused = [a for a in answers if a.status in REFUSED]
    log("floor: the same burst answered 404 by the ingress, pool idle, then busy")
    idle = await floor(url, args.requests, body, None)
    busy = await floor(url, args.requests, body, args.busy_steps)
    return {
        "statuses": dict(Counter(str(a.status) for a in answers)),
        "refused_with_retry_after": sum(a.retry_after is not None for a in refused),
        "refused": len(refused),
        "admitted_all_served": all(a.status == 200 for a in answers if a.status not in REFUSED),
        "refusal_client": spread(latencies(answers, REFUSED)),
        "served_client": spread(latencies(answers, (200,))),
        "refusal_ingress": refusals_in_the_ingress(before, after),
        "router_refused": router_refused(after) - router_refused(before),
        "floor_idle": spread(latencies(idle, (404,))),
        "floor_busy": spread(latencies(busy, (404,))),
        "records": {"burst": [[a.status, a.latency_s] for a in answers],
                    "floor_idle": [a.latency_s for a in idle], "floor_busy": [a.latency_s for a in busy]},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = bench_serve_config(load_serve_config(args.config), free_port())
    with local_ray(args.num_cpus), deployed(config) as url:
        asyncio.run(wait_ready(url))
        result = asyncio.run(run(url, args))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "burst",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "config_path": str(args.config), "requests": args.requests, "size": args.size, "steps": args.steps,
        **result,
    }
    (args.out / "burst.json").write_text(json.dumps(report, indent=1))
    records = result["records"]
    plot_latency_cdfs({f"{args.requests} requests at once": {
        "refused (429/503)": [t for s, t in records["burst"] if s in REFUSED],
        "served (200)": [t for s, t in records["burst"] if s == 200],
        "floor: 404 at once, pool idle": records["floor_idle"],
        "floor: 404 at once, pool busy": records["floor_busy"],
    }}, f"{args.requests} image requests at once ({args.config.name}, {os.cpu_count()} CPUs)", args.out / "burst.png")
    print(f"statuses {result['statuses']}; refused {result['refused']} "
          f"({result['refused_with_retry_after']} with Retry-After), by the router itself {result['router_refused']:g}")
    print(f"every admitted request served: {result['admitted_all_served']}")
    for key in ("refusal_client", "served_client", "floor_idle", "floor_busy"):
        values = result[key]
        print(f"{key:<16} " + "  ".join(f"{k} {'-' if v is None else f'{v:.0f}'}" for k, v in values.items()))
    ingress = result["refusal_ingress"]
    print(f"refusal in the ingress: {ingress['count']:g} answers, P99 <= {ingress['p99_at_most_s']} s")
    print(f"wrote {args.out / 'burst.json'} and {args.out / 'burst.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
