"""Headroom: the image arrival rate seen in snapshots, and the Poisson quantile of the images
expected within a horizon, against a brute-force sum."""

from __future__ import annotations

import math

import pytest

from stepserve.policies.composed.headroom import ImageArrivals, reserve_workers
from tests.cpu.policies.snapshots import req, slot, snap, video


def brute_quantile(mean: float, q: float, most: int) -> int:
    for r in range(most + 1):
        if sum(math.exp(-mean) * mean**k / math.factorial(k) for k in range(r + 1)) >= q:
            return r
    return most


@pytest.mark.parametrize("rate,horizon,q", [(0.2, 0.8, 0.99), (0.5, 3.0, 0.9), (2.0, 4.0, 0.99), (0.05, 1.0, 0.5),
                                            (10.0, 10.0, 0.999)])
def test_the_reserve_is_the_poisson_quantile(rate, horizon, q):
    assert reserve_workers(rate, horizon, q, 64) == brute_quantile(rate * horizon, q, 64)


def test_no_reserve_without_arrivals_or_when_off_and_never_more_than_the_pool():
    assert reserve_workers(0.0, 5.0, 0.99, 8) == 0
    assert reserve_workers(1.0, 5.0, 0.0, 8) == 0
    assert reserve_workers(100.0, 5.0, 0.99, 8) == 8


def test_arrivals_count_images_once_and_forget_them_after_the_window():
    arrivals = ImageArrivals(window_s=10.0)
    pool = {"w0": slot(4)}
    arrivals.observe(snap(pool, [req("a", arrival=0.0), video("v", arrival=0.0)], now=0.0))
    arrivals.observe(snap(pool, [req("a", arrival=0.0), req("b", arrival=1.5)], now=2.0))
    assert arrivals.rate(2.0) == pytest.approx(2 / 2.0)  # two images (not the video) in 2 s observed
    arrivals.observe(snap(pool, [req("c", arrival=4.0)], now=4.0))
    assert arrivals.rate(4.0) == pytest.approx(3 / 4.0)
    arrivals.observe(snap(pool, [], now=10.5))  # a has left the window
    assert arrivals.rate(10.5) == pytest.approx(2 / 10.0)
    arrivals.observe(snap(pool, [], now=30.0))
    assert arrivals.rate(30.0) == 0.0
