"""VAE chunking granularity, C_max and B_max (§III-C, Eq. 1-2) on hand numbers."""

from __future__ import annotations

import pytest

from stepserve.policies.synerdiff import (
    ChunkTiming,
    choose_chunks,
    chunk_cost,
    max_chunks,
    saturation_batch,
    unet_latency,
    unet_overhead,
    vae_latency,
)

# A UNet step takes 50 ms alone, a whole decode 100 ms alone (seconds below). One chunk beside
# one step: they fight for bandwidth, the step nearly doubles. Finer chunks interfere less with
# the UNet (its overhead falls) but the decode now waits for a UNet step in every round but the
# last (its latency grows): the trade-off Eq. 1 weighs.
UNET_SOLO, VAE_SOLO = 0.050, 0.100
C1 = ChunkTiming(1, (0.095,), (0.100,))
C2 = ChunkTiming(2, (0.060, 0.060), (0.055, 0.055))
C4 = ChunkTiming(4, (0.052,) * 4, (0.027,) * 4)
C8 = ChunkTiming(8, (0.051,) * 8, (0.014,) * 8)


def test_eq2_latencies():
    assert unet_latency(C1) == pytest.approx(0.100)  # the step waits for the whole decode
    assert vae_latency(C1) == pytest.approx(0.100)
    assert unet_latency(C2) == pytest.approx(0.120)
    assert vae_latency(C2) == pytest.approx(0.060 + 0.055)  # the last chunk does not wait for its step
    assert unet_latency(C4) == pytest.approx(0.208)
    assert vae_latency(C4) == pytest.approx(3 * 0.052 + 0.027)
    # max() per round: a round lasts as long as the slower of the two
    assert unet_latency(ChunkTiming(2, (0.05, 0.02), (0.03, 0.04))) == pytest.approx(0.09)
    assert vae_latency(ChunkTiming(2, (0.05, 0.02), (0.03, 0.04))) == pytest.approx(0.09)


def test_finer_chunks_cut_unet_overhead_and_stretch_the_decode():
    timings = (C1, C2, C4, C8)
    overheads = [unet_overhead(t, UNET_SOLO) for t in timings]
    decodes = [vae_latency(t) for t in timings]
    assert overheads == sorted(overheads, reverse=True)
    assert decodes == sorted(decodes)
    assert overheads[0] == pytest.approx(1.0) and overheads[2] == pytest.approx(0.04)


def test_eq1_cost():
    # L(2) = 0.5 * (0.120 - 0.100) / 0.100 + 0.5 * (0.115 - 0.100) / 0.100
    assert chunk_cost(C2, UNET_SOLO, VAE_SOLO, 0.5) == pytest.approx(0.5 * 0.2 + 0.5 * 0.15)
    assert chunk_cost(C2, UNET_SOLO, VAE_SOLO, 1.0) == pytest.approx(0.2)
    assert chunk_cost(C2, UNET_SOLO, VAE_SOLO, 0.0) == pytest.approx(0.15)
    assert chunk_cost(C1, UNET_SOLO, VAE_SOLO, 0.5) == pytest.approx(0.5)


def test_max_chunks_is_the_coarsest_within_the_overhead():
    assert max_chunks([C8, C2, C1, C4], UNET_SOLO) == 4  # 4 % <= 5 %; 8 is not needed
    assert max_chunks([C1, C2, C4, C8], UNET_SOLO, overhead=0.2) == 2
    assert max_chunks([C1, C2], UNET_SOLO) == 2  # nothing gets within 5 %: the finest measured


def test_choose_chunks_balances_the_two_overheads():
    timings = [C1, C2, C4, C8]
    # L(1) = 0.5, L(2) = 0.175, L(4) = 0.02 + 0.415 = 0.435; 8 is beyond C_max.
    assert choose_chunks(timings, UNET_SOLO, VAE_SOLO) == 2
    assert choose_chunks(timings, UNET_SOLO, VAE_SOLO, lam=1.0) == 4  # only the UNet counts
    assert choose_chunks(timings, UNET_SOLO, VAE_SOLO, lam=0.0) == 1  # only the decode counts
    assert choose_chunks(timings, UNET_SOLO, VAE_SOLO, lam=1.0, overhead=0.2) == 2


def test_choose_chunks_breaks_ties_toward_fewer_chunks():
    # Dyadic, so both costs are exactly 0.5: a's UNet overhead is 1 and its decode's 0, b's are
    # 0.5 and 0.5.
    a = ChunkTiming(1, (0.25,), (0.25,))
    b = ChunkTiming(2, (0.1875, 0.1875), (0.125, 0.1875))
    assert chunk_cost(a, 0.125, 0.25, 0.5) == chunk_cost(b, 0.125, 0.25, 0.5) == 0.5
    assert choose_chunks([b, a], 0.125, 0.25, overhead=1.0) == 1


def test_saturation_batch():
    # throughput (per s): 1 -> 10, 2 -> 16.7, 4 -> 22.2, 8 -> 23.5, 16 -> 23.9
    steps = {1: 0.1, 2: 0.12, 4: 0.18, 8: 0.34, 16: 0.67}
    assert saturation_batch(steps) == 8
    assert saturation_batch(steps, within=0.1) == 4
    assert saturation_batch(steps, within=0.0) == 16
    assert saturation_batch({3: 0.2}) == 3


@pytest.mark.parametrize("make", [
    lambda: ChunkTiming(0, (), ()),
    lambda: ChunkTiming(2, (0.1,), (0.1, 0.1)),
    lambda: ChunkTiming(1, [0.1], (0.1,)),
    lambda: ChunkTiming(1, (0.0,), (0.1,)),
    lambda: ChunkTiming(1, (0.1,), (float("nan"),)),
    lambda: chunk_cost(C2, UNET_SOLO, VAE_SOLO, 1.5),
    lambda: chunk_cost(C2, 0.0, VAE_SOLO, 0.5),
    lambda: chunk_cost(C2, UNET_SOLO, -1.0, 0.5),
    lambda: max_chunks([], UNET_SOLO),
    lambda: max_chunks([C2, ChunkTiming(2, (0.1, 0.1), (0.1, 0.1))], UNET_SOLO),
    lambda: max_chunks([C2], UNET_SOLO, overhead=-0.1),
    lambda: saturation_batch({}),
    lambda: saturation_batch({0: 0.1}),
    lambda: saturation_batch({1: 0.0}),
    lambda: saturation_batch({1: 0.1}, within=1.5),
])
def test_validation(make):
    with pytest.raises(ValueError):
        make()
