from prometheus_client.parser import text_string_to_metric_families

import dataclasses

import pytest

from stepserve.actors.activation_cache import CacheStats
from stepserve.actors.metrics import CACHE_EVENTS, CACHE_LEVELS, ROUTER_STAGES, RouterMetrics
from stepserve.policies.patchedserve import HoldoutReport
from stepserve.policies.types import RequestKind, RequestSpec, RequestStatus
from stepserve.routing.core import RequestState


def spec(kind=RequestKind.T2I, model="tiny-sd", slo_s=None) -> RequestSpec:
    return RequestSpec("r", model, "a fox", 64, 64, 20, 7.5, 0, kind=kind, slo_s=slo_s)


def samples(metrics: RouterMetrics, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples if s.name == name}


def state(kind=RequestKind.T2I, ready=1.5, admit=2.0, denoised=6.0, steps=20) -> RequestState:
    return RequestState("r", kind, RequestStatus.FINISHED, steps, steps, (), 1.0, ready, admit, denoised, None,
                        None, 0, 0, ())


def stage_sums(metrics: RouterMetrics) -> dict[tuple[str, str, str], tuple[float, float]]:
    sums: dict[tuple[str, str, str], list[float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name in ("stepserve_request_stage_seconds_sum", "stepserve_request_stage_seconds_count"):
                key = (s.labels["model"], s.labels["kind"], s.labels["stage"])
                sums.setdefault(key, [0.0, 0.0])[s.name.endswith("_count")] = s.value
    return {k: tuple(v) for k, v in sums.items()}


def test_a_finished_request_is_split_into_its_stages():
    metrics = RouterMetrics()
    metrics.finished(spec(), state(), now=6.25)
    metrics.finished(spec(RequestKind.T2V, model="tiny-wan"), state(RequestKind.T2V, steps=4), now=7.0)
    sums = stage_sums(metrics)
    image = {stage: sums[("tiny-sd", "image", stage)] for stage in ROUTER_STAGES}
    assert image == {"text_encode": (0.5, 1), "queue": (0.5, 1), "denoise": (4.0, 1), "step": (0.2, 1),
                     "decode": (0.25, 1)}
    assert sums[("tiny-wan", "video", "step")] == (1.0, 1) and sums[("tiny-wan", "video", "decode")] == (1.0, 1)


def test_a_request_that_skipped_a_stage_is_counted_but_not_split():
    metrics = RouterMetrics()
    metrics.finished(spec(), state(ready=None), now=7.0)
    assert stage_sums(metrics) == {}
    assert samples(metrics, "stepserve_requests_total") == {(("model", "tiny-sd"), ("status", "finished")): 1}


def test_requests_with_an_slo_count_as_met_missed_or_failed_by_model_and_kind():
    metrics = RouterMetrics()
    metrics.finished(spec(slo_s=6.0), state(), now=7.0)  # 6 s from arrival at 1.0: met
    metrics.finished(spec(slo_s=5.0), state(), now=7.0)  # missed
    metrics.finished(spec(), state(), now=7.0)  # best effort: no objective to meet
    metrics.ended(spec(slo_s=5.0), "failed")
    metrics.ended(spec(slo_s=5.0), "cancelled")  # withdrawn, not missed
    metrics.ended(spec(RequestKind.T2V, model="tiny-wan", slo_s=60.0), "refused")
    assert samples(metrics, "stepserve_slo_requests_total") == {
        (("kind", "image"), ("model", "tiny-sd"), ("outcome", outcome)): 1.0 for outcome in ("met", "missed", "failed")}
    assert samples(metrics, "stepserve_requests_total") == {
        (("model", "tiny-sd"), ("status", "finished")): 3, (("model", "tiny-sd"), ("status", "failed")): 1,
        (("model", "tiny-sd"), ("status", "cancelled")): 1, (("model", "tiny-wan"), ("status", "refused")): 1}


def test_each_step_of_a_plan_is_observed_and_the_plan_once():
    metrics = RouterMetrics()
    metrics.observe_plan("w0", 0.3, steps=3)
    metrics.observe_plan("w0", 0.01, steps=0)  # admitted or finished only: no step
    assert samples(metrics, "stepserve_step_latency_seconds_count") == {(("worker", "w0"),): 3}
    assert samples(metrics, "stepserve_step_latency_seconds_sum") == {(("worker", "w0"),): pytest.approx(0.3)}
    assert samples(metrics, "stepserve_worker_plan_seconds_count") == {(("worker", "w0"),): 2}


def test_an_activation_stores_counts_are_counters_and_its_levels_gauges():
    assert set(CACHE_LEVELS) | set(CACHE_EVENTS) == {f.name for f in dataclasses.fields(CacheStats)}
    metrics = RouterMetrics()
    metrics.observe_activation_cache("0123456789abcdef", CacheStats(*range(11)))
    events = samples(metrics, "stepserve_activation_cache_events_total")
    assert events[(("event", "memory_hits"), ("node", "01234567"))] == 0
    assert events[(("event", "drops"), ("node", "01234567"))] == 10
    levels = samples(metrics, "stepserve_activation_cache")
    assert levels == {(("node", "01234567"), ("stat", stat)): float(i) for i, stat in enumerate(CACHE_LEVELS, 3)}


def test_each_models_throughput_analyzer_is_exported_and_no_error_where_none_was_held_out():
    metrics = RouterMetrics()
    metrics.observe_analyzers({"tiny-sd3": HoldoutReport(38, 162, 10, 0.063, 0.275),
                               "sdxl": HoldoutReport(0, 200, 0, None, None)})
    values = {(s.labels["model"], s.labels["stat"]): s.value
              for family in text_string_to_metric_families(metrics.exposition().decode())
              for s in family.samples if s.name == "stepserve_throughput_analyzer"}
    assert values == {("tiny-sd3", "measured_samples"): 38, ("tiny-sd3", "filled_samples"): 162,
                      ("tiny-sd3", "holdout_mean_rel_err"): 0.063, ("tiny-sd3", "holdout_max_rel_err"): 0.275,
                      ("sdxl", "measured_samples"): 0, ("sdxl", "filled_samples"): 200}


def test_the_blocks_of_masked_edits_are_counted_by_how_they_ran():
    from stepserve.policies.types import EditBlockCounts

    metrics = RouterMetrics()
    metrics.observe_edit_blocks(EditBlockCounts(loaded=3, computed=1))
    metrics.observe_edit_blocks(EditBlockCounts(loaded=2, unplanned=1))
    metrics.observe_edit_blocks(EditBlockCounts())  # a plan without masked forwards
    samples = {(s.name, s.labels.get("how")): s.value for family in text_string_to_metric_families(
        metrics.exposition().decode()) for s in family.samples}
    assert samples[("stepserve_edit_blocks_total", "loaded")] == 5
    assert samples[("stepserve_edit_blocks_total", "computed")] == 1
    assert samples[("stepserve_edit_unplanned_forwards_total", None)] == 1


def test_each_workers_load_controller_is_published():
    metrics = RouterMetrics()
    metrics.observe_load_control("w0", None)  # no controller: nothing published
    assert "stepserve_load_control{" not in metrics.exposition().decode()
    metrics.observe_load_control("w0", (2 / 3, 2))
    metrics.observe_load_control("w1", (0.0, 1))
    values = {(s.labels["worker"], s.labels["setting"]): s.value
              for family in text_string_to_metric_families(metrics.exposition().decode())
              for s in family.samples if s.name == "stepserve_load_control"}
    assert values == {("w0", "load"): 2 / 3, ("w0", "decode_chunks"): 2, ("w1", "load"): 0.0,
                      ("w1", "decode_chunks"): 1}
