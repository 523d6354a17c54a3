"""What a live step costs beyond the profile, learned from the steps the router runs.

The co-serving router times every step from dispatch to report and compares it with the
profile's prediction; the difference (RPC, the worker's queue, a shared host) is smoothed per
kind of step and handed to the scheduler as `ObservedOverheadCosts`. It changes the costs only
when the estimate moved enough to matter, so the scheduler's memo of step costs survives most
decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("image", "video")


@dataclass
class StepOverhead:
    alpha: float = 0.1  # weight of the newest observation in the moving average
    min_change_s: float = 0.002  # re-calibrate when an estimate moved by more than this ...
    min_change_share: float = 0.2  # ... and by more than this share of the last applied one
    estimate: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    applied: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe(self, kind: str, observed_s: float, predicted_s: float) -> bool:
        """Fold one step in; True when the applied overheads should be updated (`apply`)."""
        extra = max(0.0, observed_s - predicted_s)
        if self.samples[kind] == 0:
            self.estimate[kind] = extra
        else:
            self.estimate[kind] += self.alpha * (extra - self.estimate[kind])
        self.samples[kind] += 1
        moved = abs(self.estimate[kind] - self.applied[kind])
        return moved > self.min_change_s and moved > self.min_change_share * self.applied[kind]

    def apply(self) -> tuple[float, float]:
        """The (image, video) overheads to use from now on."""
        self.applied = dict(self.estimate)
        return self.applied["image"], self.applied["video"]
