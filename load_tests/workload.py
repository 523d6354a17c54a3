"""A seeded open-loop workload: Poisson arrivals of text-to-image requests with mixed step counts.

Pure Python and deterministic by seed, so two policies (or a live run and a simulated one) can
be fed exactly the same requests at exactly the same offsets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

DEFAULT_PROMPT = "a watercolor painting of a lighthouse on a cliff at dusk"


@dataclass(frozen=True)
class PoissonWorkload:
    rate: float  # mean arrivals per second
    duration_s: float | None = None  # arrivals stop at this offset ...
    num_requests: int | None = None  # ... or after this many (exactly one of the two)
    steps_choices: tuple[int, ...] = (10, 20, 40)  # each request draws one, uniformly
    width: int = 128
    height: int = 128
    guidance_scale: float = 7.5
    prompt: str = DEFAULT_PROMPT
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration_s or num_requests")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.steps_choices or any(s < 1 for s in self.steps_choices):
            raise ValueError(f"steps_choices must be positive step counts, got {self.steps_choices}")


@dataclass(frozen=True)
class ScheduledRequest:
    index: int
    offset_s: float  # send time, seconds after the run starts
    num_inference_steps: int
    seed: int
    width: int
    height: int
    guidance_scale: float
    prompt: str

    def body(self) -> dict[str, Any]:
        """The JSON body of `POST /v1/images/generations` (a fresh dict each call)."""
        return {
            "prompt": self.prompt, "n": 1, "size": f"{self.width}x{self.height}",
            "num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
            "seed": self.seed,
        }


def generate(workload: PoissonWorkload) -> list[ScheduledRequest]:
    """The requests of one run, in send order."""
    rng = random.Random(workload.seed)
    requests: list[ScheduledRequest] = []
    offset = 0.0
    while workload.num_requests is None or len(requests) < workload.num_requests:
        # Exponential gaps make the arrival count in any window Poisson-distributed.
        offset += rng.expovariate(workload.rate)
        if workload.duration_s is not None and offset >= workload.duration_s:
            break
        # Draw order is fixed (gap, steps, seed) so a seed always means the same requests.
        steps = rng.choice(workload.steps_choices)
        seed = rng.randrange(2**31)
        requests.append(ScheduledRequest(
            index=len(requests), offset_s=offset, num_inference_steps=steps, seed=seed,
            width=workload.width, height=workload.height, guidance_scale=workload.guidance_scale,
            prompt=workload.prompt,
        ))
    return requests
