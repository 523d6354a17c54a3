"""What a live step costs beyond the profile, learned from the plans the router runs.

The router times every plan from when the worker could start it to its report and compares
that with the profile's prediction; the difference (the round trip, the worker's bookkeeping,
a shared host) is smoothed per kind of request and handed to the scheduler in the snapshot
(`ClusterSnapshot.step_overhead_s`). It republishes only when an estimate moved enough to
matter, so the scheduler's memo of step costs survives most rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stepserve.policies.types import RequestKind


@dataclass
class StepOverhead:
    alpha: float = 0.1  # weight of the newest observation in the moving average
    min_change_s: float = 0.002  # republish when an estimate moved by more than this ...
    min_change_share: float = 0.2  # ... and by more than this share of the published one
    estimate: dict[RequestKind, float] = field(default_factory=lambda: dict.fromkeys(RequestKind, 0.0))
    applied: dict[RequestKind, float] = field(default_factory=lambda: dict.fromkeys(RequestKind, 0.0))
    samples: dict[RequestKind, int] = field(default_factory=lambda: dict.fromkeys(RequestKind, 0))

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe(self, kind: RequestKind, observed_s: float, predicted_s: float) -> bool:
        """Fold one plan in; True when the published overheads changed."""
        extra = max(0.0, observed_s - predicted_s)
        if self.samples[kind] == 0:
            self.estimate[kind] = extra
        else:
            self.estimate[kind] += self.alpha * (extra - self.estimate[kind])
        self.samples[kind] += 1
        moved = abs(self.estimate[kind] - self.applied[kind])
        if moved > self.min_change_s and moved > self.min_change_share * self.applied[kind]:
            self.applied[kind] = self.estimate[kind]
            return True
        return False

    def applied_by_kind(self) -> dict[RequestKind, float]:
        """The overheads the scheduler predicts with now."""
        return dict(self.applied)
