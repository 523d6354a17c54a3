"""The load feedback controller's transitions (§III-D, last paragraph)."""

from __future__ import annotations

import pytest

from stepserve.policies.synerdiff import ControllerConfig, ControllerState, chunks, observe, quality, start

CONFIG = ControllerConfig(quality_levels=(1.0, 0.98, 0.95), chunk_levels=(2, 3, 4), window=3, rise=1)


def feed(state, lengths, config=CONFIG):
    for length in lengths:
        state = observe(config, state, length)
    return state


def setting(state, config=CONFIG):
    return quality(config, state), chunks(config, state)


def test_start_is_best_quality_and_offline_chunking():
    state = start(CONFIG)
    assert state == ControllerState(0, 0, ())
    assert setting(state) == (1.0, 2)


def test_buildup_lowers_quality_first_then_raises_chunks_one_notch_per_window():
    state = feed(start(CONFIG), [0, 1])
    assert setting(state) == (1.0, 2) and state.history == (0, 1)  # window not full yet
    state = observe(CONFIG, state, 2)
    assert setting(state) == (0.98, 2) and state.history == ()  # a change starts a fresh window
    steps = []
    for window in ([2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 10]):
        state = feed(state, window)
        steps.append(setting(state))
    assert steps == [(0.95, 2), (0.95, 3), (0.95, 4), (0.95, 4)]
    assert state.history == (8, 9, 10)  # nothing left to raise: the window keeps sliding


def test_recovery_undoes_chunks_first_then_quality():
    state = ControllerState(2, 2, ())
    steps = []
    for window in ([10, 9, 8], [8, 7, 6], [6, 5, 4], [4, 3, 2], [2, 1, 1]):
        state = feed(state, window)
        steps.append(setting(state))
    assert steps == [(0.95, 3), (0.95, 2), (0.98, 2), (1.0, 2), (1.0, 2)]


def test_an_empty_queue_for_a_whole_window_counts_as_falling_load():
    state = feed(ControllerState(1, 1, ()), [0, 0])
    assert setting(state) == (0.98, 3)
    state = observe(CONFIG, state, 0)
    assert setting(state) == (0.98, 2) and state.history == ()
    assert setting(feed(state, [0, 0, 0])) == (1.0, 2)
    assert feed(start(CONFIG), [0, 0, 0, 0]) == ControllerState(0, 0, (0, 0, 0))


def test_a_flat_or_noisy_queue_changes_nothing():
    state = feed(ControllerState(1, 1, ()), [5, 5, 5, 5, 5, 5])
    assert setting(state) == (0.98, 3) and state.history == (5, 5, 5)
    # the trend is first to last: a peak in the middle is not a buildup
    assert setting(feed(ControllerState(1, 1, ()), [5, 9, 5])) == (0.98, 3)


def test_rise_sets_how_much_the_queue_must_move():
    config = ControllerConfig((1.0, 0.95), (2, 3), window=2, rise=3)
    assert setting(feed(start(config), [1, 3], config), config) == (1.0, 2)
    assert setting(feed(start(config), [1, 4], config), config) == (0.95, 2)
    assert setting(feed(ControllerState(1, 1, ()), [6, 4], config), config) == (0.95, 3)
    assert setting(feed(ControllerState(1, 1, ()), [6, 3], config), config) == (0.95, 2)


def test_observe_is_pure():
    state = ControllerState(1, 0, (3, 4))
    assert observe(CONFIG, state, 5) == observe(CONFIG, state, 5) == ControllerState(2, 0, ())
    assert state == ControllerState(1, 0, (3, 4))


@pytest.mark.parametrize("kwargs", [
    dict(quality_levels=(), chunk_levels=(2,)),
    dict(quality_levels=(0.95, 1.0), chunk_levels=(2,)),
    dict(quality_levels=(1.0, 1.0), chunk_levels=(2,)),
    dict(quality_levels=(1.2,), chunk_levels=(2,)),
    dict(quality_levels=[1.0], chunk_levels=(2,)),
    dict(quality_levels=(1.0,), chunk_levels=()),
    dict(quality_levels=(1.0,), chunk_levels=(3, 2)),
    dict(quality_levels=(1.0,), chunk_levels=(0, 2)),
    dict(quality_levels=(1.0,), chunk_levels=(2,), window=1),
    dict(quality_levels=(1.0,), chunk_levels=(2,), rise=0),
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError, match="ControllerConfig"):
        ControllerConfig(**kwargs)


def test_state_and_observation_validation():
    with pytest.raises(ValueError):
        ControllerState(-1, 0)
    with pytest.raises(ValueError):
        ControllerState(0, 0, [1])
    with pytest.raises(ValueError):
        ControllerState(0, 0, (-1,))
    with pytest.raises(ValueError, match="queue_length"):
        observe(CONFIG, start(CONFIG), -1)
    with pytest.raises(ValueError, match="out of range"):
        observe(CONFIG, ControllerState(3, 0), 1)
    with pytest.raises(ValueError, match="longer than the window"):
        observe(CONFIG, ControllerState(0, 0, (1, 2, 3, 4)), 1)
