"""The worker's loading DP (InstGenIE §4.2): the planner picks what `pipeline_dp` picks for the
measured costs of the forward's shape (a block computes every token where that wins), loads every
slot without costs (counted) and for a keys-values record; the served masked forward with a mixed
choice equals the engine's masked forward with that plan; the tally counts what ran."""

import random

import pytest
import torch

from stepserve.engine.editing.loading_plan import BlockTally, LoadingPlanner
from stepserve.engine.editing.masked_sd3 import CacheKind, MaskedPlan
from stepserve.engine.template_edits import EditMember, TemplateEdit, template_forward
from stepserve.engine.text_encoding import embed
from stepserve.policies.cost_model import BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD, ProfileRow
from stepserve.policies.instgenie.block_profile import MeasuredBlockCosts
from stepserve.policies.instgenie.pipeline_dp import Loading, plan
from stepserve.policies.types import EditBlockCounts
from stepserve.profiling.common import PROMPT, first_timestep, forward_inputs
from stepserve.profiling.edits import masked_tokens, self_records

MODEL = "tiny-sd3"


def measured(c_with, c_without, load, rows=2, size=64, share=0.25, model=MODEL) -> MeasuredBlockCosts:
    """A profile's block rows for one shape: C_w at `share` (seconds, per slot), C_wo and L."""
    def row(component, slot, seconds, ratio=1.0):
        return ProfileRow(model, "cpu", component, size, size, rows, 1, seconds * 1e3, 3, "measured",
                          mask_ratio=ratio, slot=slot)
    return MeasuredBlockCosts.from_rows(
        [row(BLOCK_CACHED, s, c, share) for s, c in enumerate(c_with)]
        + [row(BLOCK_FULL, s, c) for s, c in enumerate(c_without)]
        + [row(BLOCK_LOAD, s, c) for s, c in enumerate(load)])


def choose(planner, slots=2, rows=2, share=0.25, kind=CacheKind.OUTPUTS):
    return planner.use_cache(kind, slots, MODEL, 64, 64, rows, share)


@pytest.mark.parametrize("loading", [Loading.ALGORITHM1, Loading.OPTIMAL])
def test_the_planner_picks_what_the_dp_picks_for_the_measured_costs(loading):
    rng = random.Random(0)
    for _ in range(50):
        costs = [tuple(rng.uniform(0, 3) for _ in range(4)) for _ in range(3)]
        planner = LoadingPlanner(loading, measured(*costs))
        assert choose(planner, slots=4) == (plan(loading, 4, *costs).use_cache, True)


def test_a_block_computes_in_full_where_that_wins():
    # Loads slower than compute: every block computes every token, both ways.
    slow_loads = measured((0.001, 0.001), (0.002, 0.002), (0.005, 0.005))
    for loading in (Loading.ALGORITHM1, Loading.OPTIMAL):
        assert choose(LoadingPlanner(loading, slow_loads)) == ((False, False), True)
    # Algorithm 1 loads both (ending at 20); the optimum computes the first in full (ending at 11).
    greedy_loses = measured((0.0, 0.0), (0.011, 0.011), (0.010, 0.010))
    assert choose(LoadingPlanner(Loading.ALGORITHM1, greedy_loses)) == ((True, True), True)
    assert choose(LoadingPlanner(Loading.OPTIMAL, greedy_loses)) == ((False, True), True)


def test_without_costs_every_slot_loads_and_the_forward_is_unplanned():
    planner = LoadingPlanner(Loading.OPTIMAL, measured((0.0, 0.0), (0.011, 0.011), (0.010, 0.010)))
    assert choose(planner, rows=4) == ((True, True), False)  # rows beyond the measured ones
    assert choose(planner, slots=3) == ((True, True, True), False)  # a profile of another depth
    assert choose(LoadingPlanner(Loading.OPTIMAL)) == ((True, True), False)  # no profile at all
    assert choose(LoadingPlanner(Loading.ALWAYS_LOAD)) == ((True, True), True)  # needs none


def test_a_keys_values_record_is_always_loaded_whole():
    planner = LoadingPlanner(Loading.OPTIMAL, measured((0.001,) * 3, (0.002,) * 3, (0.005,) * 3))
    assert choose(planner, slots=3, kind=CacheKind.KEYS_VALUES) == ((True,) * 3, True)


def test_only_ways_to_serve_are_accepted():
    for loading in (Loading.NAIVE, Loading.IDEAL):
        with pytest.raises(ValueError, match="not a way to serve"):
            LoadingPlanner(loading)


def test_the_tally_counts_and_is_taken_once():
    tally = BlockTally()
    tally.count((False, True), True)
    tally.count((True, True, True), False)
    assert tally.take() == EditBlockCounts(loaded=4, computed=1, unplanned=1)
    assert tally.take() == EditBlockCounts()


def test_the_served_forward_with_a_mixed_choice_is_the_masked_forward_of_that_plan(tiny_sd3):
    text, t = embed(tiny_sd3, PROMPT), first_timestep(tiny_sd3)
    generator = torch.Generator("cpu").manual_seed(0)
    template = forward_inputs(tiny_sd3, text, t, 2, 64, generator)
    sample, timesteps, cond = forward_inputs(tiny_sd3, text, t, 2, 64, generator)  # another image: a real edit
    (record,) = self_records(tiny_sd3, CacheKind.OUTPUTS, 64, template, 1, 2)
    index, _ = masked_tokens(tiny_sd3, 64, 2, 0.25)
    slots = [record[f"0.{b}"] for b in range(2)]
    member = [EditMember(TemplateEdit("k", CacheKind.OUTPUTS, index, record), 2)]
    planner = LoadingPlanner(Loading.OPTIMAL, measured((0.0, 0.0), (0.011, 0.011), (0.010, 0.010),
                                                        model=tiny_sd3.source.name))
    tally = BlockTally()
    served = template_forward(tiny_sd3, member, sample, timesteps, cond, planner, tally)
    assert tally.take() == EditBlockCounts(loaded=1, computed=1)

    def masked(use_cache):
        return tiny_sd3.denoise_masked(sample, timesteps, cond, MaskedPlan(index, slots, use_cache, CacheKind.OUTPUTS))

    torch.testing.assert_close(served, masked((False, True)), atol=1e-5, rtol=1e-4)
    # The choice mattered: block 0 computed its unmasked tokens instead of taking the template's.
    assert (served - masked((True, True))).abs().max() > 1e-3
    # Four rows: the profile has no costs for them, so every slot loads, counted as unplanned.
    four = [EditMember(TemplateEdit("k", CacheKind.OUTPUTS, index, record), 2)] * 2
    inputs = forward_inputs(tiny_sd3, text, t, 4, 64, generator)
    template_forward(tiny_sd3, four, *inputs, planner, tally)
    assert tally.take() == EditBlockCounts(loaded=2, unplanned=1)
