"""The server's own view of a load run, from the app's Prometheus `GET /metrics`.

Client latencies say how long requests took; these say why: how many requests stepped
together per worker round, how long a round took, how long requests queued. The router's
histograms count from app start, so a run is the difference of a scrape before and after it.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from stepserve.load_tests.live import loopback_client

# What the router exports (actors/metrics.py), by the name results use.
HISTOGRAMS = {
    "batch_size": "stepserve_batch_size",
    "round_s": "stepserve_worker_plan_seconds",
    "worker_wait_s": "stepserve_worker_wait_seconds",  # a worker holding requests, between two plans
    "queue_wait_s": "stepserve_queue_wait_seconds",
    "denoise_s": "stepserve_denoise_latency_seconds",
    "plan_s": "stepserve_plan_seconds",  # router decision time per round; must stay far below round_s
}


def histogram_totals(exposition: str) -> dict[str, float]:
    """`<histogram>_sum` and `_count` of each histogram in HISTOGRAMS, summed over labels
    (e.g. over workers)."""
    wanted = {f"{name}{suffix}" for name in HISTOGRAMS.values() for suffix in ("_sum", "_count")}
    totals = dict.fromkeys(sorted(wanted), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] += sample.value
    return totals


def run_means(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, float | None]]:
    """Observations and their mean for each histogram between two scrapes."""
    out: dict[str, dict[str, float | None]] = {}
    for key, name in HISTOGRAMS.items():
        count = after[f"{name}_count"] - before[f"{name}_count"]
        total = after[f"{name}_sum"] - before[f"{name}_sum"]
        out[key] = {"count": count, "mean": total / count if count else None}
    return out


# An image request's stages (actors/metrics.py, deployments/ingress.py): ingress, then router.
STAGE_HISTOGRAMS = {"stepserve_ingress_stage_seconds": "ingress", "stepserve_request_stage_seconds": "router"}


def stage_totals(exposition: str, kind: str = "image") -> dict[str, float]:
    """`<where>.<stage>_sum` / `_count` of each stage of one kind of request ("image" or
    "video"), e.g. `router.queue_sum`; the ingress's stages are image stages."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name, _, suffix = sample.name.rpartition("_")
            where = STAGE_HISTOGRAMS.get(name)
            if where is None or suffix not in ("sum", "count") or sample.labels.get("kind", "image") != kind:
                continue
            key = f"{where}.{sample.labels['stage']}_{suffix}"
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def stage_means(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """Mean seconds of each stage between two `stage_totals` scrapes."""
    out: dict[str, float | None] = {}
    for key in sorted(k[:-len("_count")] for k in after if k.endswith("_count")):
        count = after[f"{key}_count"] - before.get(f"{key}_count", 0.0)
        out[key] = (after[f"{key}_sum"] - before.get(f"{key}_sum", 0.0)) / count if count else None
    return out


async def scrape_text(base_url: str) -> str:
    async with loopback_client(base_url) as client:
        response = await client.get("/metrics", timeout=10.0)
        response.raise_for_status()
        return response.text
