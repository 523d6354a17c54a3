import pytest

from stepserve.routing.pool_scaler import PoolLoad, PoolScaler, ScalingSpec


def test_it_grows_at_once_to_one_worker_per_target_and_by_one_while_requests_are_late():
    scaler = PoolScaler(ScalingSpec(min_workers=1, max_workers=4, target_requests=4))
    assert scaler.target(PoolLoad(demand=0, waiting=0, late=0), size=1, now=0.0) == 1
    assert scaler.target(PoolLoad(demand=9, waiting=5, late=0), size=1, now=1.0) == 3  # ceil(9 / 4)
    assert scaler.target(PoolLoad(demand=2, waiting=1, late=1), size=3, now=2.0) == 4
    assert scaler.target(PoolLoad(demand=100, waiting=90, late=5), size=4, now=3.0) == 4  # the bound


def test_it_shrinks_one_worker_a_delay_and_only_after_a_lull_that_lasts():
    scaler = PoolScaler(ScalingSpec(min_workers=1, max_workers=4, scale_down_delay_s=10.0))
    idle = PoolLoad(demand=0, waiting=0, late=0)
    assert scaler.target(idle, size=3, now=0.0) == 3
    assert scaler.target(idle, size=3, now=9.0) == 3
    busy = PoolLoad(demand=20, waiting=4, late=0)
    assert scaler.target(busy, size=3, now=9.5) == 4  # the lull ended: the wait starts over
    assert scaler.target(idle, size=4, now=10.0) == 4
    assert scaler.target(idle, size=4, now=20.0) == 3
    assert scaler.target(idle, size=3, now=25.0) == 3  # the next one waits a whole delay again
    assert scaler.target(idle, size=3, now=30.0) == 2
    assert scaler.target(idle, size=1, now=100.0) == 1  # never below the minimum


def test_nothing_drains_while_requests_wait_even_when_the_demand_fits_fewer():
    scaler = PoolScaler(ScalingSpec(min_workers=1, max_workers=4, target_requests=8, scale_down_delay_s=0.0))
    assert scaler.target(PoolLoad(demand=9, waiting=1, late=0), size=4, now=0.0) == 4
    assert scaler.target(PoolLoad(demand=9, waiting=0, late=0), size=4, now=1.0) == 3


def test_a_pool_below_its_minimum_grows_to_it():
    scaler = PoolScaler(ScalingSpec(min_workers=2, max_workers=4))
    assert scaler.target(PoolLoad(0, 0, 0), size=1, now=0.0) == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"min_workers": 0, "max_workers": 2}, "min_workers"),
    ({"min_workers": 3, "max_workers": 2}, "min_workers"),
    ({"min_workers": 1, "max_workers": 2, "target_requests": 0}, "target_requests"),
    ({"min_workers": 1, "max_workers": 2, "scale_down_delay_s": -1}, "scale_down_delay_s"),
])
def test_bad_bounds_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScalingSpec(**kwargs)
