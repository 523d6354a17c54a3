"""Prometheus metrics of the router: one registry per router, served by the ingress, with the
ingress replicas' own HTTP metrics summed into it (`actors.replica_metrics`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from stepserve.actors.replica_metrics import ReplicaSums
from stepserve.policies.patchedserve.predictor import HoldoutReport
from stepserve.policies.types import EditBlockCounts, RequestKind, RequestSpec
from stepserve.routing.core import RequestState

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 100)
# What an activation store's `CacheStats` holds now, and what it counts from its start.
CACHE_LEVELS = ("memory_values", "memory_bytes", "disk_values", "disk_bytes")
CACHE_EVENTS = ("memory_hits", "disk_hits", "misses", "bytes_loaded", "bytes_spilled", "evictions", "drops")
# A finished request's time inside the router, in order (the ingress adds its own stages).
ROUTER_STAGES = ("text_encode", "queue", "denoise", "step", "decode")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ingress = ReplicaSums()  # every ingress replica's last push, summed
        r.register(self.ingress)
        self.queue_length = Gauge("stepserve_queue_length", "Requests waiting for a worker (queued or paused).",
                                  ["kind"], registry=r)
        self.running = Gauge("stepserve_running_requests", "Requests resident on workers.", registry=r)
        self.decoding = Gauge("stepserve_decoding_requests", "Denoised requests being decoded or stored.",
                              registry=r)
        self.step_latency = Histogram(
            "stepserve_step_latency_seconds", "Time of one denoising step on a worker: its plan's time over the "
            "steps the plan ran, observed once per step.", ["worker"], buckets=STEP_BUCKETS, registry=r,
        )
        self.worker_plan = Histogram(
            "stepserve_worker_plan_seconds", "Time a worker took to execute one plan (all its groups and steps).",
            ["worker"], buckets=STEP_BUCKETS, registry=r,
        )
        self.queued_steps = Gauge("stepserve_queued_steps", "Denoising steps still to run of the requests waiting "
                                  "for a worker (queued or paused).", ["kind"], registry=r)
        self.batch_size = Histogram(
            "stepserve_batch_size", "Requests stepping together in one worker plan.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), registry=r,
        )
        self.worker_wait = Histogram(
            "stepserve_worker_wait_seconds", "Time a worker holding requests sat between two plans (the "
            "hand-off: its report's trip, the router's round, the next plan's trip; near 0 when pipelined).",
            ["worker"], buckets=STEP_BUCKETS, registry=r,
        )
        self.plan_latency = Histogram(
            "stepserve_plan_seconds", "Router decision time per scheduling round (snapshot + policy + checks).",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2), registry=r,
        )
        self.requests = Counter("stepserve_requests", "Requests by final status and model ('refused': turned away by "
                                "the router itself, past the ingress's admission gate).", ["status", "model"],
                                registry=r)
        self.slo = Counter(
            "stepserve_slo_requests", "Requests with a latency objective (their model's `slo_s`) by how they ended: "
            "met (finished within it, arrival to result), missed (finished late) or failed. Attainment is met over "
            "all; goodput is the rate of met.", ["model", "kind", "outcome"], registry=r)
        self.queue_wait = Histogram(
            "stepserve_queue_wait_seconds", "Arrival to first admission on a worker.", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.denoise_latency = Histogram(
            "stepserve_denoise_latency_seconds", "Arrival to last denoising step.", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_overhead = Gauge(
            "stepserve_step_overhead_seconds",
            "What a step costs beyond its profile (round trip, worker bookkeeping), as the scheduler now "
            "predicts it.", ["kind"], registry=r,
        )
        self.load_control = Gauge(
            "stepserve_load_control",
            "Each worker's SynerDiff load controller (`vae_decoder.load_controller`) after its last plan: "
            "'load', how far it has moved skip-CFG starts toward their floors (0: not at all, 1: there); "
            "'decode_chunks', the chunks of a decode that starts now.",
            ["worker", "setting"], registry=r,
        )
        self.activation_cache = Gauge(
            "stepserve_activation_cache",
            "Each node's activation store (`edit_cache`) now: templates and bytes held in memory and on disk.",
            ["node", "stat"], registry=r)
        self.activation_cache_events = _CacheEvents()  # its counts since it started
        r.register(self.activation_cache_events)

        # InstGenIE's loading DP on the workers (`edit_cache.loading`), from each plan's report.
        self.edit_blocks = Counter(
            "stepserve_edit_blocks", "Blocks of masked forwards of template edits, by how: loaded (the block used "
            "its template's cached activations) or computed (the loading DP had it compute every token instead).",
            ["how"], registry=r)
        self.edit_unplanned = Counter(
            "stepserve_edit_unplanned_forwards", "Masked forwards of template edits whose shape the profile had no "
            "block costs for: they loaded every block.", registry=r)
        self.worker_restarts = Counter("stepserve_worker_restarts", "Denoiser workers lost and restarted.",
                                       registry=r)
        self.pool_workers = Gauge(
            "stepserve_pool_workers", "Denoiser workers by state: serving (taking plans), starting (loading, or "
            "waiting for a node from Ray's autoscaler) and draining (handing their requests back).", ["state"],
            registry=r)
        self.pool_target = Gauge("stepserve_pool_target_workers", "The size the pool scaler last set "
                                 "(`workers.autoscaling`; a fixed pool: num_workers).", registry=r)
        self.pool_changes = Counter("stepserve_pool_changes", "Workers the pool scaler started (grow) or drained and "
                                    "removed (shrink).", ["direction"], registry=r)
        self.recoveries = Counter(
            "stepserve_recoveries", "Requests that lost their state to a worker fault and resumed from their "
            "last checkpoint.", registry=r)

        self.lora_wait = Histogram(
            "stepserve_lora_wait_seconds",
            "Time spent on LoRAs loading: queue (a request exactly waiting in the queue for the LoRA store to "
            "hold its LoRAs, per LoRA request) and batch (a plan's time bringing LoRAs to its worker, times the "
            "requests stepping in it: what the batch waited, summed over its requests).",
            ["where"], buckets=STAGE_BUCKETS, registry=r)
        self.lora_join_bound = Gauge(
            "stepserve_lora_join_bound",
            "How late each served LoRA may join a request, as a fraction of its steps (`loras[].join_by`, its "
            "profiled bound, else `lora_loading.join_by`; 0: exact, the request waits for it in the queue).",
            ["model", "lora"], registry=r)
        self.split_steps = Counter(
            "stepserve_split_steps", "Denoising steps of one request split over several workers, counted once "
            "per request and step, by how: cfg (its two CFG rows, latent parallelism) or sequence (Ulysses).",
            ["split"], registry=r)
        # PatchedServe's Throughput Analyzer (issue 36: served = measured); set once, when the policy is built.
        self.throughput_analyzer = Gauge(
            "stepserve_throughput_analyzer",
            "The latency predictor each model's policy trained (PatchedServe's Throughput Analyzer): "
            "measured_samples and filled_samples (batches the profile measured, and the cost model's where none "
            "was measured, it trained on), holdout_mean_rel_err and holdout_max_rel_err (its relative error on the "
            "20% of measured batches held out of training; absent where none could be held out).",
            ["model", "stat"], registry=r)
        self.request_stage = Histogram(
            "stepserve_request_stage_seconds",
            "Where a finished request's time went in the router: text_encode (arrival to embeddings), queue "
            "(embeddings to first admission), denoise (first admission to last step), step (denoise / steps: one "
            "step including the wait between steps), decode (last step to decoded PNG, or to the stored video).",
            ["model", "kind", "stage"], buckets=STAGE_BUCKETS, registry=r,
        )

    def finished(self, spec: RequestSpec, state: RequestState, now: float) -> None:
        """Count a finished request, whether it met its SLO, and observe its stages (see `request_stage`)."""
        kind = _kind(spec.kind)
        self.requests.labels("finished", spec.model).inc()
        if spec.slo_s is not None:
            self.slo.labels(spec.model, kind, "met" if now - state.arrival_time <= spec.slo_s else "missed").inc()
        if state.ready_time is None or state.admit_time is None or state.denoised_time is None:
            return  # nothing to split: it never went through every stage
        denoise = state.denoised_time - state.admit_time
        for stage, seconds in zip(ROUTER_STAGES, (
                state.ready_time - state.arrival_time, state.admit_time - state.ready_time, denoise,
                denoise / max(1, state.steps_total), now - state.denoised_time)):
            self.request_stage.labels(spec.model, kind, stage).observe(max(0.0, seconds))

    def ended(self, spec: RequestSpec, status: str) -> None:
        """Count a request that ended without a result: 'failed', 'cancelled' or 'refused'. A failed
        request with an SLO did not meet it; a cancelled one withdrew, a refused one never started."""
        self.requests.labels(status, spec.model).inc()
        if status == "failed" and spec.slo_s is not None:
            self.slo.labels(spec.model, _kind(spec.kind), "failed").inc()

    def observe_plan(self, worker: str, duration_s: float, steps: int) -> None:
        """A plan's time, and each of the steps it ran (a plan that only admitted or finished ran none)."""
        self.worker_plan.labels(worker).observe(duration_s)
        for _ in range(steps):
            self.step_latency.labels(worker).observe(duration_s / steps)

    def observe_analyzers(self, reports: Mapping[str, HoldoutReport]) -> None:
        """Each model's `HoldoutReport` (the patchedserve policy's `holdout`)."""
        for model, report in reports.items():
            stats = {"measured_samples": report.measured, "filled_samples": report.filled,
                     "holdout_mean_rel_err": report.mean_rel_err, "holdout_max_rel_err": report.max_rel_err}
            for stat, value in stats.items():
                if value is not None:
                    self.throughput_analyzer.labels(model, stat).set(value)

    def observe_activation_cache(self, node: str, stats: Any) -> None:
        """A node's `actors.activation_cache.CacheStats`: its levels as gauges, its counts as counters."""
        for stat in CACHE_LEVELS:
            self.activation_cache.labels(node[:8], stat).set(getattr(stats, stat))
        self.activation_cache_events.latest[node[:8]] = stats

    def observe_load_control(self, worker: str, control: tuple[float, int] | None) -> None:
        """A plan's `StepReport.load_control` (None: the worker runs no load controller)."""
        if control is not None:
            load, chunks = control
            self.load_control.labels(worker, "load").set(load)
            self.load_control.labels(worker, "decode_chunks").set(chunks)

    def observe_edit_blocks(self, counts: EditBlockCounts) -> None:
        """One plan's `StepReport.edit_blocks` (most plans run no masked forward: nothing to count)."""
        if not (counts.loaded or counts.computed or counts.unplanned):
            return
        self.edit_blocks.labels("loaded").inc(counts.loaded)
        self.edit_blocks.labels("computed").inc(counts.computed)
        self.edit_unplanned.inc(counts.unplanned)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _kind(kind: RequestKind) -> str:
    """A request's class as the metrics name it (as `stepserve_queue_length` does)."""
    return "video" if kind is RequestKind.T2V else "image"


class _CacheEvents:
    """The activation stores' counts as counters (`stepserve_activation_cache_events_total{node, event}`):
    the stores count them, the router publishes each node's latest (a restarted store starts at 0,
    which Prometheus reads as a counter reset)."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}  # node -> its last `CacheStats`

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "stepserve_activation_cache_events", "Each node's activation store (`edit_cache`) since it started: "
            "gets that hit memory or disk or missed, bytes read back from and spilled to disk, evictions (out of "
            "memory) and drops (out of the store).", labels=["node", "event"])
        for node, stats in self.latest.items():
            for event in CACHE_EVENTS:
                family.add_metric([node, event], getattr(stats, event))
        yield family
