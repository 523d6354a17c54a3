"""Edit workloads: the traces' mask-ratio distributions, which requests become edits, and what a
simulated edit costs."""

from __future__ import annotations

import random
import statistics
from dataclasses import fields

import pytest

from stepserve.load_tests.bench_mask_balance_sim import FLUX, derive, flux_costs
from stepserve.load_tests.edit_workload import TRACES, EditMix, MaskRatios, ScheduledEdit, with_edits
from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.workload import ScheduledRequest
from stepserve.policies.cost_model import BatchShape


@pytest.mark.parametrize(("name", "mean"), [("instgenie", 0.11), ("public", 0.19), ("viton", 0.35)])
def test_the_traces_have_the_papers_means_and_a_wide_spread(name, mean):
    rng = random.Random(0)
    ratios = [TRACES[name].draw(rng) for _ in range(20_000)]
    assert statistics.mean(ratios) == pytest.approx(mean, abs=0.005)
    assert statistics.pstdev(ratios) > 0.6 * mean  # coefficient of variation: 0.6 (viton) to 1.3
    assert min(ratios) >= 0.01 and max(ratios) <= 1.0 and max(ratios) > 0.6


def request(index, frames=None):
    return ScheduledRequest(index, float(index), 28, index, 1024, 1024, 1.0, f"p{index}", model=FLUX,
                            num_frames=frames)


def test_with_edits_is_deterministic_and_keeps_every_other_field():
    requests = [request(i) for i in range(400)] + [request(400, frames=16)]
    mix = EditMix.trace("public", share=0.5, cached=0.5)
    edits = with_edits(requests, mix, seed=1)
    assert edits == with_edits(requests, mix, seed=1) != with_edits(requests, mix, seed=2)
    assert edits[-1] is requests[-1]  # a video stays a video
    made = [e for e in edits if isinstance(e, ScheduledEdit)]
    assert 150 < len(made) < 250
    assert 0.3 < sum(e.template_id is not None for e in made) / len(made) < 0.7
    for e in made:
        original = requests[e.index]
        assert all(getattr(e, f.name) == getattr(original, f.name) for f in fields(original))
    # The draws do not depend on the share: the edits of a larger share include these.
    everything = with_edits(requests, EditMix.trace("public", share=1.0, cached=0.5), seed=1)
    assert all(everything[e.index] == e for e in made)
    with pytest.raises(ValueError):
        EditMix.trace("nope")
    with pytest.raises(ValueError):
        MaskRatios(1.5)


@pytest.mark.parametrize("template", ["t", None])
def test_a_simulated_edit_steps_at_its_mask_ratio_only_with_its_template_cached(template):
    costs = flux_costs(derive(25.0)["lines"][FLUX], 25.0, 8)
    edit = ScheduledEdit(0, 0.0, 28, 0, 1024, 1024, 1.0, "p", model=FLUX, mask_ratio=0.2, template_id=template)
    (trace,) = simulate([edit], costs, SimConfig(workers=1)).traces
    step = costs.step_seconds(BatchShape(FLUX, 1024, 1024, 1, mask_ratio=0.2 if template else 1.0))
    assert trace.finish_s - trace.admit_s == pytest.approx(28 * step)
    full = costs.step_seconds(BatchShape(FLUX, 1024, 1024, 1))
    assert (step < 0.6 * full) if template else step == full
