from prometheus_client.parser import text_string_to_metric_families

from stepserve.actors.metrics import ROUTER_STAGES, RouterMetrics
from stepserve.policies.patchedserve import HoldoutReport
from stepserve.policies.types import RequestKind, RequestStatus
from stepserve.routing.core import RequestState


def state(kind=RequestKind.T2I, ready=1.5, admit=2.0, denoised=6.0, steps=20) -> RequestState:
    return RequestState("r", kind, RequestStatus.FINISHED, steps, steps, (), 1.0, ready, admit, denoised, None,
                        None, 0, 0, ())


def stage_sums(metrics: RouterMetrics) -> dict[tuple[str, str], tuple[float, float]]:
    sums: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name in ("stepserve_request_stage_seconds_sum", "stepserve_request_stage_seconds_count"):
                key = (s.labels["kind"], s.labels["stage"])
                sums.setdefault(key, [0.0, 0.0])[s.name.endswith("_count")] = s.value
    return {k: tuple(v) for k, v in sums.items()}


def test_a_finished_request_is_split_into_its_stages():
    metrics = RouterMetrics()
    metrics.finished(state(), now=6.25)
    metrics.finished(state(RequestKind.T2V, steps=4), now=7.0)
    sums = stage_sums(metrics)
    image = {stage: sums[("image", stage)] for stage in ROUTER_STAGES}
    assert image == {"text_encode": (0.5, 1), "queue": (0.5, 1), "denoise": (4.0, 1), "step": (0.2, 1),
                     "decode": (0.25, 1)}
    assert sums[("video", "step")] == (1.0, 1) and sums[("video", "decode")] == (1.0, 1)


def test_a_request_that_skipped_a_stage_is_counted_but_not_split():
    metrics = RouterMetrics()
    metrics.finished(state(ready=None), now=7.0)
    assert stage_sums(metrics) == {}
    assert "stepserve_requests_total{status=\"finished\"} 1.0" in metrics.exposition().decode()


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
