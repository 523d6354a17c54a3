"""The Throughput Analyzer: its dataset, its held-out error on mixed-resolution pricing, and the
batch latency the scheduler reads from it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve.policies.cost_model import BatchShape, load_profile
from stepserve.policies.patchedserve import (
    BatchLatency,
    PackedForwardCosts,
    ThroughputAnalyzer,
    holdout_error,
    random_compositions,
    training_samples,
)
from stepserve.policies.patchedserve.samples import round_seconds
from stepserve.policies.types import RequestKind, RequestStatus, RequestView, ShapeKey

SIZES = ((512, 512), (768, 768), (1024, 1024))
MODELS = {"sdxl-h800": "stable-diffusion-xl-base-1.0", "genserve-rtx6000": "sd3.5-medium"}


def view(rid: str, size: int, model: str, rows: int = 2, loras: tuple[str, ...] = ()) -> RequestView:
    return RequestView(rid, RequestKind.T2I, ShapeKey(model, size, size), rows, 0, 50, 0.0, 10.0, True,
                       RequestStatus.QUEUED, loras=loras)


@pytest.fixture(scope="module", params=sorted(MODELS))
def trained(request):
    """Each profile's packed pricing, its dataset (§6.1: 200 combinations) and the analyzer fitted
    on 80% of it with the held-out report. The profiles are derived, so the cost model's prices
    stand for measured ones here: what is scored is how well the MLP learns a pricing."""
    pricing = PackedForwardCosts(load_profile(request.param))
    model = MODELS[request.param]
    samples = [replace(s, measured=True)
               for s in training_samples(pricing, model, SIZES, max_requests=12, count=200, seed=0)]
    analyzer, report = holdout_error(samples, seed=0)
    return pricing, model, samples, analyzer, report


def test_the_dataset_is_distinct_batches_within_the_cap_and_the_same_for_a_seed():
    batches = random_compositions(SIZES, max_requests=12, count=200, seed=3)
    assert len(batches) == len(set(batches)) == 200
    assert batches == random_compositions(SIZES, max_requests=12, count=200, seed=3)
    assert batches != random_compositions(SIZES, max_requests=12, count=200, seed=4)
    for batch in batches:
        assert {size for size, _ in batch} <= set(SIZES)
        assert 1 <= sum(rows for _, rows in batch) <= 24 and all(rows > 0 for _, rows in batch)
    # The corners a busy worker holds (many requests of one size) are in it.
    assert sum(1 for batch in batches if len(batch) == 1 and batch[0][1] >= 16) >= 5


def test_asking_for_more_batches_than_exist_is_an_error():
    with pytest.raises(ValueError, match="distinct"):
        random_compositions(((512, 512),), max_requests=2, count=5, seed=0, rows_choices=(2,))


def test_held_out_error_on_mixed_resolution_pricing_is_within_the_papers(trained):
    _, model, samples, _, report = trained
    assert (report.measured, report.filled) == (160, 0) and 30 <= report.test <= 40
    # The paper: under 3.7% on its held-out 20%. Measured here (seed 0): SDXL 0.4% mean / 2.0%
    # max, SD3 0.8% / 8.6%; the bound on the max leaves room for another BLAS.
    assert report.mean_rel_err < 0.037, report
    assert report.max_rel_err < 0.15, report


def test_the_analyzer_is_deterministic_and_answers_only_what_it_covers(trained):
    pricing, model, samples, analyzer, _ = trained
    batch = (((512, 512), 4), ((1024, 1024), 6))
    once, again = (ThroughputAnalyzer.fit(samples[:100], seed=0) for _ in range(2))
    assert once.predict(batch) == again.predict(batch)
    assert once.predict(batch) != ThroughputAnalyzer.fit(samples[:100], seed=1).predict(batch)
    assert analyzer.predict(batch) == pytest.approx(round_seconds(pricing, model, batch), rel=0.05)
    assert not analyzer.covers((((640, 640), 2),))
    assert not analyzer.covers((((512, 512), analyzer.max_rows + 1),))
    with pytest.raises(ValueError, match="outside"):
        analyzer.predict((((640, 640), 2),))


def test_one_analyzer_per_model():
    pricing = PackedForwardCosts(load_profile("sdxl-h800"))
    samples = training_samples(pricing, MODELS["sdxl-h800"], SIZES, count=20)
    other = [replace(s, model="other") for s in samples[:5]]
    with pytest.raises(ValueError, match="one analyzer per model"):
        ThroughputAnalyzer.fit(samples + other)


def test_batch_latency_reads_the_analyzer_where_it_covers_the_batch_and_prices_the_rest(trained):
    pricing, model, _, analyzer, _ = trained
    latency = BatchLatency(pricing, {model: analyzer})
    mixed = [view("a", 512, model), view("b", 512, model), view("c", 1024, model, rows=1)]
    assert latency.step_seconds(mixed) == analyzer.predict((((512, 512), 4), ((1024, 1024), 1)))
    # A size outside the vocabulary, and a LoRA request, are priced by the cost model.
    odd = [view("a", 512, model), view("d", 640, model)]
    assert latency.step_seconds(odd) == round_seconds(pricing, model, (((512, 512), 2), ((640, 640), 2)))
    styled = [view("a", 512, model, loras=("papercut",))]
    assert latency.step_seconds(styled) == pricing.round_seconds([BatchShape(model, 512, 512, 2, lora_rows=2)])
    assert latency.step_seconds([]) == 0.0
    assert BatchLatency(pricing).step_seconds(mixed) == round_seconds(pricing, model,
                                                                      (((512, 512), 4), ((1024, 1024), 1)))
