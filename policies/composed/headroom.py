"""Headroom for images (the composed policy's own component): how many workers to keep free for
images that will arrive before a worker given to a video comes back.

GenServe's DP spends every idle worker on SP upgrades (§4.3: "upgrade SP when GPUs are idle"),
which is right for the requests present and wrong for the next image: it waits for a video's
step boundary, up to a whole step of a large video, and an image whose SLO is its solo latency
(the slides' σ = 1) has no such wait to spare. Measured (ablation_genserve, σ = 1, 18 req/min):
the full GenServe policy meets 58% of images where FCFS, which leaves workers idle, meets 85%.

The expected images are counted, not guessed: the arrivals of the last `window_s` give a rate,
a worker given to a video is held for one of its steps (`horizon_s`), and the reserve is the
`quantile` of the Poisson count of images in that time. A reserved worker is worth only
RESERVE_WEIGHT in the round's score (policies/genserve/scoring.py): it beats an SP upgrade and
nothing that serves a request.
"""

from __future__ import annotations

import math
from collections import deque

from stepserve.policies.types import ClusterSnapshot


class ImageArrivals:
    """Image (and edit) arrivals seen in the snapshots of the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._times: deque[tuple[float, str]] = deque()  # (arrival, id), oldest first
        self._ids: set[str] = set()  # the ids in _times
        self._since: float | None = None  # the first snapshot's time

    def observe(self, snapshot: ClusterSnapshot) -> None:
        now = snapshot.now
        if self._since is None:
            self._since = now
        new = [(v.arrival_time, v.request_id) for v in snapshot.queued
               if not v.is_video and v.request_id not in self._ids and v.arrival_time > now - self.window_s]
        if new:  # rare (arrivals only), and the window holds few: re-sorting is cheap
            self._times = deque(sorted([*self._times, *new]))
            self._ids.update(rid for _, rid in new)
        while self._times and self._times[0][0] <= now - self.window_s:
            self._ids.discard(self._times.popleft()[1])

    def rate(self, now: float) -> float:
        """Images per second over the window (over the time observed, while shorter)."""
        if self._since is None:
            return 0.0
        span = min(self.window_s, max(now - self._since, 1.0))
        return len(self._times) / span


def reserve_workers(rate: float, horizon_s: float, quantile: float, most: int) -> int:
    """The `quantile` of the number of Poisson(rate) arrivals in `horizon_s`, at most `most`."""
    mean = rate * horizon_s
    if not (quantile > 0 and mean > 0 and math.isfinite(mean)):
        return 0
    term = total = math.exp(-mean)
    count = 0
    while total < quantile and count < most:
        count += 1
        term *= mean / count
        total += term
    return count
