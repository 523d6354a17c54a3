"""Prometheus metrics of the router: one registry per router, served by the ingress."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stepserve.policies.patchedserve.predictor import HoldoutReport
from stepserve.policies.types import EditBlockCounts, RequestKind
from stepserve.routing.core import RequestState

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 100)
# A finished request's time inside the router, in order (the ingress adds its own stages).
ROUTER_STAGES = ("text_encode", "queue", "denoise", "step", "decode")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("stepserve_queue_length", "Requests waiting for a worker (queued or paused).",
                                  ["kind"], registry=r)
        self.running = Gauge("stepserve_running_requests", "Requests resident on workers.", registry=r)
        self.decoding = Gauge("stepserve_decoding_requests", "Denoised requests being decoded or stored.",
                              registry=r)
        self.step_latency = Histogram(
            "stepserve_step_latency_seconds", "Time to execute one worker plan (all its groups).",
            ["worker"], buckets=STEP_BUCKETS, registry=r,
        )
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
        self.requests = Counter("stepserve_requests", "Requests by final status ('refused': turned away by the router "
                                "itself, past the ingress's admission gate).", ["status"], registry=r)
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
            "Each node's activation store (`edit_cache`): gets that hit memory or disk or missed, templates and "
            "bytes held in memory and on disk, bytes read back from and spilled to disk, evictions and drops.",
            ["node", "stat"], registry=r,
        )

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
            ["kind", "stage"], buckets=STAGE_BUCKETS, registry=r,
        )

    def finished(self, state: RequestState, now: float) -> None:
        """Count a finished request and observe its stages (see `request_stage`)."""
        self.requests.labels("finished").inc()
        if state.ready_time is None or state.admit_time is None or state.denoised_time is None:
            return  # nothing to split: it never went through every stage
        kind = "video" if state.kind is RequestKind.T2V else "image"  # as stepserve_queue_length says
        denoise = state.denoised_time - state.admit_time
        for stage, seconds in zip(ROUTER_STAGES, (
                state.ready_time - state.arrival_time, state.admit_time - state.ready_time, denoise,
                denoise / max(1, state.steps_total), now - state.denoised_time)):
            self.request_stage.labels(kind, stage).observe(max(0.0, seconds))

    def observe_analyzers(self, reports: Mapping[str, HoldoutReport]) -> None:
        """Each model's `HoldoutReport` (the patchedserve policy's `holdout`)."""
        for model, report in reports.items():
            stats = {"measured_samples": report.measured, "filled_samples": report.filled,
                     "holdout_mean_rel_err": report.mean_rel_err, "holdout_max_rel_err": report.max_rel_err}
            for stat, value in stats.items():
                if value is not None:
                    self.throughput_analyzer.labels(model, stat).set(value)

    def observe_activation_cache(self, node: str, stats: Any) -> None:
        """A node's `actors.activation_cache.CacheStats`."""
        for stat, value in vars(stats).items():
            self.activation_cache.labels(node[:8], stat).set(value)

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
