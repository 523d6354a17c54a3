"""Router histograms between two scrapes, on real exposition text from the router's registry."""

from __future__ import annotations

import pytest

from stepserve.actors.metrics import RouterMetrics
from stepserve.load_tests.server_metrics import histogram_totals, run_means


def test_means_over_a_run_sum_workers_and_exclude_earlier_observations():
    metrics = RouterMetrics()
    metrics.batch_size.observe(8)  # warm-up, before the run
    metrics.worker_plan.labels("w0").observe(1.0)
    before = histogram_totals(metrics.exposition().decode())
    for size in (1, 2, 3):
        metrics.batch_size.observe(size)
    metrics.worker_plan.labels("w0").observe(0.02)
    metrics.worker_plan.labels("w1").observe(0.04)
    after = histogram_totals(metrics.exposition().decode())

    means = run_means(before, after)
    assert means["batch_size"] == {"count": 3, "mean": pytest.approx(2.0)}
    assert means["round_s"] == {"count": 2, "mean": pytest.approx(0.03)}
    assert means["queue_wait_s"] == {"count": 0, "mean": None}


def test_stage_means_cover_one_kind_and_the_run_only():
    from stepserve.routing.core import RequestState
    from stepserve.load_tests.server_metrics import stage_means, stage_totals
    from stepserve.policies.types import RequestKind, RequestSpec, RequestStatus

    def finished(kind, admit):
        metrics.finished(RequestSpec("r", "m", "p", 64, 64, 2, 7.5, 0, kind=kind),
                         RequestState("r", kind, RequestStatus.FINISHED, 2, 2, (), 0.0, 0.5, admit, 3.0, None, None,
                                      0, 0, ()), now=3.5)

    metrics = RouterMetrics()
    finished(RequestKind.T2I, admit=1.0)  # before the run
    before = metrics.exposition().decode()
    finished(RequestKind.T2I, admit=2.0)
    finished(RequestKind.T2V, admit=0.5)  # videos are not an image's stages
    after = metrics.exposition().decode()
    means = stage_means(stage_totals(before), stage_totals(after))
    assert means["router.queue"] == pytest.approx(1.5) and means["router.step"] == pytest.approx(0.5)
    assert means["router.text_encode"] == pytest.approx(0.5) and means["router.decode"] == pytest.approx(0.5)
    videos = stage_means(stage_totals(before, "video"), stage_totals(after, "video"))
    assert videos["router.queue"] == pytest.approx(0.0) and videos["router.denoise"] == pytest.approx(2.5)
