"""The Throughput Analyzer trained on measured batches (issue 36, served = measured): the profile's
rows become samples at their measured seconds, the cost model fills in only what no row measured,
the held-out error is scored on measured batches only, and the served policy trains so."""

from __future__ import annotations

import random

import pytest

from stepserve.actors.router import RouterSpec, router_costs
from stepserve.actors.worker_options import WorkerPoolSpec
from stepserve.engine.families import ModelSource
from stepserve.policies import make_policy
from stepserve.policies.cost_model import DENOISE, ProfileRow, load_profile
from stepserve.policies.patchedserve import (
    LatencySample,
    ThroughputAnalyzer,
    holdout_error,
    measured_samples,
    training_samples,
)
from stepserve.policies.patchedserve.samples import round_seconds
from stepserve.routing.core import CoreConfig

TINY = ((64, 64), (128, 128), (256, 256))
SOURCE = "measured 2026-11-28 test"


def row(size: int, rows: int, ms: float, groups=(), source: str = SOURCE, **extra) -> ProfileRow:
    return ProfileRow("m", "cpu", DENOISE, size, size, rows, 1, ms, 3, source, groups=groups, **extra)


def overhead(batches) -> float:
    return 0.001 + 0.0001 * len(batches)  # a fixed cost and one per group, as a profile's round overheads


def test_measured_rows_become_samples_at_their_measured_seconds_plus_the_rounds_overheads():
    rows = [
        row(64, 2, 5.0),
        row(128, 4, 9.0, groups=((64, 64, 2), (128, 128, 2))),  # a packed forward of two sizes
        row(64, 4, 7.0), row(64, 4, 9.0), row(64, 4, 8.5),  # measured three times: the median
        row(64, 8, 11.0, source="GenServe slides; derived"),  # not a measurement
        row(64, 2, 3.0, sp_degree=2), row(64, 2, 2.0, mask_ratio=0.5),  # not a plain forward on one worker
        row(512, 2, 30.0),  # not one of the analyzer's sizes
        ProfileRow("other", "cpu", DENOISE, 64, 64, 1, 1, 4.0, 3, SOURCE),
    ]
    samples = measured_samples(rows, "m", TINY, overhead)
    assert samples == [
        LatencySample("m", (((64, 64), 2),), 0.005 + 0.0011, True),
        LatencySample("m", (((64, 64), 2), ((128, 128), 2)), 0.009 + 0.0012, True),
        LatencySample("m", (((64, 64), 4),), 0.0085 + 0.0011, True),
    ]


def test_filled_in_samples_never_replace_or_repeat_a_measured_batch():
    profile = load_profile("tiny-sd3-cpu")
    measured = measured_samples(profile.profile_rows, "tiny-sd3", TINY, profile.round_overhead_seconds)
    assert len(measured) == 48 and sum(len(s.composition) > 1 for s in measured) == 12  # 36 one-size, 12 packed
    samples = training_samples(profile, "tiny-sd3", TINY, 12, 200, 0, measured)
    filled = [s for s in samples if not s.measured]
    assert samples[:len(measured)] == measured
    assert not {s.composition for s in filled} & {s.composition for s in measured}
    assert len({s.composition for s in samples}) == len(samples)
    # Some random batches were measured ones (so the rule was exercised) and were dropped, not priced.
    assert 0 < 200 - len(filled) == len({s.composition for s in training_samples(profile, "tiny-sd3", TINY)}
                                        & {s.composition for s in measured})
    assert all(s.seconds == round_seconds(profile, "tiny-sd3", s.composition) for s in filled)


def linear(composition) -> float:
    return 0.002 + sum(rows * (h / 64) ** 2 * 0.001 for (h, _), rows in composition)


@pytest.fixture(scope="module")
def mixed():
    """25 measured batches at one pace and 60 filled in at twice it: scored together, the error
    would show the filled-in ones."""
    rng = random.Random(1)
    measured, filled, seen = [], [], set()
    while len(measured) + len(filled) < 85:
        composition = tuple(sorted((size, rng.randint(1, 8)) for size in rng.sample(TINY, rng.randint(1, 2))))
        if composition in seen:
            continue
        seen.add(composition)
        if len(measured) < 25:
            measured.append(LatencySample("m", composition, linear(composition), True))
        else:
            filled.append(LatencySample("m", composition, 2 * linear(composition), False))
    return measured, filled


def test_the_held_out_error_is_scored_on_measured_batches_only(mixed):
    measured, filled = mixed
    samples = filled[:30] + measured + filled[30:]  # where the filled-in ones sit does not matter
    analyzer, report = holdout_error(samples, seed=0, iterations=300)
    # The oracle: the same 80/20 split of the measured batches, every filled-in one trained on.
    order = list(range(25))
    random.Random(0).shuffle(order)
    kept, held = [measured[i] for i in order[:20]], [measured[i] for i in order[20:]]
    oracle = ThroughputAnalyzer.fit(kept + filled, seed=0, iterations=300)
    errors = [abs(oracle.predict(s.composition) - s.seconds) / s.seconds for s in held if oracle.covers(s.composition)]
    assert (report.measured, report.filled, report.train, report.test) == (20, 60, 80, len(errors)) and errors
    assert report.mean_rel_err == pytest.approx(sum(errors) / len(errors)) and report.max_rel_err == max(errors)
    assert analyzer.predict(held[0].composition) == oracle.predict(held[0].composition)
    # The analyzer follows the filled-in majority (twice the measured pace), so its error on the
    # held-out measured batches is large; any filled-in batch in the score would pull it down.
    on_filled = [abs(analyzer.predict(s.composition) - s.seconds) / s.seconds for s in filled]
    assert sum(on_filled) / len(on_filled) < 0.2 < 0.4 < report.mean_rel_err


def test_without_measured_batches_to_hold_out_there_is_no_error_to_report(mixed):
    measured, filled = mixed
    for samples in (filled, filled + measured[:2]):  # none measured; two, both trained on (80% of 2 rounds to 2)
        _, report = holdout_error(samples, seed=0, iterations=50)
        assert report.test == 0 and report.mean_rel_err is None and report.max_rel_err is None
        assert report.measured == len(samples) - len(filled) and report.filled == len(filled)
        assert "n/a" in report.format("m")


def test_the_served_policy_trains_on_the_profiles_measured_and_packed_batches():
    """Built as the router builds it (the profile wrapped in packed pricing), the policy's
    analyzer trains on tiny-sd3's 48 measured batches, 12 of them packed forwards."""
    spec = RouterSpec("patchedserve", {"sizes": [list(s) for s in TINY]}, ("tiny-sd3-cpu",), CoreConfig())
    costs = router_costs(spec, [ModelSource("tiny-sd3", "sd3", preset="tiny")], WorkerPoolSpec(pack_resolutions=True))
    policy = make_policy("patchedserve", spec.policy_options, costs)
    report = policy.holdout["tiny-sd3"]
    assert report.measured + report.test == 48 and report.test == 10 and report.filled > 100
    # Measured here (seed 0): mean 6.3%, max 27.5% (the worst, 256 px alone, whose smaller
    # neighbours were all held out too); the bounds leave room for another BLAS.
    assert report.mean_rel_err < 0.12 and report.max_rel_err < 0.5
    analyzer = policy.latency.analyzers["tiny-sd3"]
    measured = measured_samples(costs.profile_rows, "tiny-sd3", TINY, costs.round_overhead_seconds)
    packed = [s for s in measured if len(s.composition) == 3]
    assert packed and all(analyzer.predict(s.composition) == pytest.approx(s.seconds, rel=0.1) for s in packed)


def test_a_derived_profile_fills_in_every_batch_and_reports_no_error():
    policy = make_policy("patchedserve", {}, load_profile("sdxl-h800"))
    report = policy.holdout["stable-diffusion-xl-base-1.0"]
    assert (report.measured, report.filled, report.mean_rel_err) == (0, 200, None)
    assert set(policy.latency.analyzers) == {"stable-diffusion-xl-base-1.0"}
