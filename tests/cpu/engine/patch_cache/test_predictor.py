"""The reuse predictor: recorded from exact generations of the tiny SD3 model (which recording
leaves unchanged), fitted deterministically, scored on a generation it never saw; on synthetic
samples it recovers a threshold rule, and never learns to reuse more as inputs drift more."""

import math

import pytest
import torch

from stepserve.engine.patch_cache.calibration import record_generations
from stepserve.engine.patch_cache.predictor import ReusePredictor, fit_predictor, score
from stepserve.engine.patch_cache.statistics import ReuseSamples
from stepserve.engine.sampler import Sampler

from tests.tiny import conditioning_for, make_spec

SIZE = 256  # 32 x 32 latents: 16 x 16 tokens, 16 patches of 4 x 4
STEPS = 6
SIDE = 4
TOLERANCE = 3e-3


def _samplers(family, seeds, prompts):
    specs = [make_spec(f"r{seed}", steps=STEPS, seed=seed, size=SIZE, prompt=prompt, model="tiny-sd3")
             for seed, prompt in zip(seeds, prompts)]
    return [Sampler(spec, family, conditioning_for(family, spec)) for spec in specs]


@pytest.fixture(scope="module")
def recorded(tiny_sd3):
    """Two generations to fit on, a third to score on."""
    train = record_generations(tiny_sd3, _samplers(tiny_sd3, (1, 2), ("a red fox", "a city at night")), SIDE)
    held_out = record_generations(tiny_sd3, _samplers(tiny_sd3, (3,), ("a bowl of fruit",)), SIDE)
    return train.samples(), held_out.samples()


def _blocks(family) -> int:
    return len(family.denoiser.transformer_blocks)


def test_recording_leaves_the_generation_exact(tiny_sd3):
    (recorded,) = _samplers(tiny_sd3, (4,), ("a boat",))
    (plain,) = _samplers(tiny_sd3, (4,), ("a boat",))
    statistics = record_generations(tiny_sd3, [recorded], SIDE, ages=2)
    while not plain.done:
        plain.step(tiny_sd3)
    assert recorded.done and torch.equal(recorded.latents, plain.latents)
    # Steps 2.. against the last step, steps 3.. also against the one before: rows x blocks x patches each.
    assert len(statistics.samples()) == (STEPS - 1 + STEPS - 2) * 2 * _blocks(tiny_sd3) * 16


def test_fit_is_deterministic_and_beats_the_majority_on_a_generation_it_never_saw(tiny_sd3, recorded):
    train, held_out = recorded
    predictor = fit_predictor(train, TOLERANCE, _blocks(tiny_sd3))
    assert fit_predictor(train, TOLERANCE, _blocks(tiny_sd3)) == predictor
    assert predictor.change_weight < 0
    result = score(predictor, held_out)
    assert result.samples == len(held_out)
    assert result.accuracy >= 0.9 and result.accuracy > result.majority + 0.05
    assert result.false_reuse < 0.05 and 0 < result.reused < 1


def _synthetic(n: int, seed: int) -> ReuseSamples:
    """Two blocks; reuse's error is the input change times 2 in block 0, times 10 in block 1."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 2, (n,), generator=g)
    change = 10 ** (-4 + 3 * torch.rand(n, generator=g, dtype=torch.float64))
    return ReuseSamples(block, torch.rand(n, generator=g, dtype=torch.float64), change,
                        change * torch.where(block == 0, 2.0, 10.0).double())


def test_fit_recovers_a_threshold_rule_per_block():
    predictor = fit_predictor(_synthetic(4000, seed=0), 1e-2, blocks=2)
    result = score(predictor, _synthetic(2000, seed=1))
    assert result.accuracy > 0.99
    # Thresholds on the input change: 5e-3 in block 0, 1e-3 in block 1 (at the mean noise level).
    for block, threshold in ((0, 5e-3), (1, 1e-3)):
        at = -(predictor.block_bias[block] + predictor.noise_weight * 0.5) / predictor.change_weight
        assert abs(at - math.log10(threshold)) < 0.05


def test_the_input_change_never_argues_for_reuse():
    """Labels that reward drift (reusable when the input moved a lot) leave the input change's
    weight at about zero, never positive."""
    samples = _synthetic(2000, seed=2)
    backwards = ReuseSamples(samples.block, samples.noise_level, samples.input_change, 1 / samples.output_change)
    predictor = fit_predictor(backwards, 100.0, blocks=2)
    assert -1e-3 < predictor.change_weight <= 0


def test_score_counts_by_hand():
    samples = ReuseSamples(torch.tensor([0, 0, 0, 0]), torch.zeros(4, dtype=torch.float64),
                           torch.tensor([1e-4, 1e-4, 1e-1, 1e-1], dtype=torch.float64),
                           torch.tensor([1e-4, 1e-1, 1e-1, 1e-4], dtype=torch.float64))
    below = ReusePredictor(change_weight=-1.0, noise_weight=0.0, block_bias=(-2.0,), tolerance=1e-2)  # change < 1e-2
    result = score(below, samples)
    assert (result.samples, result.accuracy, result.majority, result.reused, result.false_reuse) == (4, 0.5, 0.5,
                                                                                                     0.5, 0.25)


def test_fit_refuses_what_it_cannot_fit(recorded):
    train, _ = recorded
    with pytest.raises(ValueError, match="block 1"):
        fit_predictor(train, TOLERANCE, blocks=1)
    with pytest.raises(ValueError, match="tolerance"):
        fit_predictor(train, 0.0, blocks=2)
