"""SynerDiff's load feedback controller (§III-D, last paragraph).

"Upon detecting queue buildup, the controller raises the quality threshold S to increase
Skip-CFG frequency and boost throughput, while restoring it as load subsides to prioritize
image fidelity. If throughput remains insufficient even at the minimum quality threshold
S_min, the controller increments VAE Chunking granularity c."

The paper gives no trend detector; the one here is the simplest that moves one notch per trend:

- it keeps the last `window` queue lengths (sampled by the caller, e.g. once per round);
- buildup: the window is full, the queue grew by >= `rise` from its first to its last sample
  and is not empty. The first remedy is quality (one level down the ladder: more tasks past
  s_min, more skip-CFG); only at the lowest allowed quality S_min does c go up one level;
- load falling: the window is full and the queue shrank by >= `rise`, or it was empty for the
  whole window. Remedies are undone in reverse: c back down first (chunking costs every decode
  latency), then quality back up;
- after any change the window starts over, so one trend moves one notch, and the next notch
  needs a fresh window of evidence measured under the new setting.

A pure transition: the state is a value, the caller keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.policies.synerdiff.checks import check_int, check_number


@dataclass(frozen=True)
class ControllerConfig:
    """quality_levels: the quality threshold S from the best (1.0: no skip-CFG) down to S_min,
    strictly decreasing. chunk_levels: the VAE chunking c from the offline choice up to C_max,
    strictly increasing."""

    quality_levels: tuple[float, ...]
    chunk_levels: tuple[int, ...]
    window: int = 4
    rise: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.quality_levels, tuple) or not self.quality_levels:
            raise ValueError(f"ControllerConfig: quality_levels must be a non-empty tuple, got {self.quality_levels!r}")
        for level in self.quality_levels:
            check_number("ControllerConfig", "quality_levels[]", level, 0.0, 1.0)
        if any(a <= b for a, b in zip(self.quality_levels, self.quality_levels[1:])):
            raise ValueError(f"ControllerConfig: quality_levels must be strictly decreasing (best first), "
                             f"got {self.quality_levels!r}")
        if not isinstance(self.chunk_levels, tuple) or not self.chunk_levels:
            raise ValueError(f"ControllerConfig: chunk_levels must be a non-empty tuple, got {self.chunk_levels!r}")
        for level in self.chunk_levels:
            check_int("ControllerConfig", "chunk_levels[]", level, 1)
        if any(a >= b for a, b in zip(self.chunk_levels, self.chunk_levels[1:])):
            raise ValueError(f"ControllerConfig: chunk_levels must be strictly increasing (offline c first), "
                             f"got {self.chunk_levels!r}")
        # A trend needs two samples: with one, first and last are the same.
        check_int("ControllerConfig", "window", self.window, 2)
        check_int("ControllerConfig", "rise", self.rise, 1)


@dataclass(frozen=True)
class ControllerState:
    """Indices into the config's levels, and the last queue lengths seen (oldest first)."""

    quality: int
    chunks: int
    history: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_int("ControllerState", "quality", self.quality, 0)
        check_int("ControllerState", "chunks", self.chunks, 0)
        if not isinstance(self.history, tuple):
            raise ValueError(f"ControllerState: history must be a tuple, got {self.history!r}")
        for length in self.history:
            check_int("ControllerState", "history[]", length, 0)


def start(config: ControllerConfig) -> ControllerState:
    """Best quality, the offline chunking, no samples yet."""
    return ControllerState(0, 0, ())


def quality(config: ControllerConfig, state: ControllerState) -> float:
    return config.quality_levels[state.quality]


def chunks(config: ControllerConfig, state: ControllerState) -> int:
    return config.chunk_levels[state.chunks]


def observe(config: ControllerConfig, state: ControllerState, queue_length: int) -> ControllerState:
    """The state after one more queue-length sample."""
    check_int("observe", "queue_length", queue_length, 0)
    if state.quality >= len(config.quality_levels) or state.chunks >= len(config.chunk_levels):
        raise ValueError(f"observe: state {state} is out of range of the config's levels")
    if len(state.history) > config.window:
        raise ValueError(f"observe: state history {state.history} is longer than the window {config.window}")
    history = (state.history + (queue_length,))[-config.window:]
    if len(history) < config.window:
        return ControllerState(state.quality, state.chunks, history)
    first, last = history[0], history[-1]
    if last - first >= config.rise and last > 0:
        if state.quality < len(config.quality_levels) - 1:
            return ControllerState(state.quality + 1, state.chunks, ())
        if state.chunks < len(config.chunk_levels) - 1:
            return ControllerState(state.quality, state.chunks + 1, ())
    elif first - last >= config.rise or not any(history):
        if state.chunks > 0:
            return ControllerState(state.quality, state.chunks - 1, ())
        if state.quality > 0:
            return ControllerState(state.quality - 1, state.chunks, ())
    # No trend, or nothing left to change: keep sliding the window.
    return ControllerState(state.quality, state.chunks, history)
