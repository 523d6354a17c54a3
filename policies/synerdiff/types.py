"""What SynerDiff's offline profiler hands the online planner, and what the planner returns.

    §III-C  the lookup table T_cost^c(m, n, k) of tau_{m,n,k} and delta_{m,n,k}   ConcurrencyTable
    §III-D  one stage (m_t, n_t, k_t) of an execution sequence S                    Round
    §III-D  the sequence S with its objective J (Eq. 3a-3b) and length (Eq. 3f)     SequencePlan

Frozen dataclasses, validated on construction, so a malformed profile row fails where the table
is built rather than inside the DP. Nothing here knows about Ray, torch, files or the clock: a
CSV reader elsewhere turns rows into plain tuples for `ConcurrencyTable.from_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from stepserve.policies.synerdiff.checks import check_int, check_number


@dataclass(frozen=True, order=True)
class Round:
    """One concurrent round (m, n, k): `unet` tasks take one denoising step while `vae` tasks
    decode beside them, and `skip` of the `unet` tasks run that step without CFG.

    Ordered as the tuple (unet, vae, skip), which is the planner's last tie-break.
    Eq. 3d's n <= m is a property of a plan, not of a round: a table may hold (0, n, 0) rows,
    decodes with nothing denoising.
    """

    unet: int
    vae: int
    skip: int

    def __post_init__(self) -> None:
        check_int("Round", "unet", self.unet, 0)
        check_int("Round", "vae", self.vae, 0)
        check_int("Round", "skip", self.skip, 0)
        if self.skip > self.unet:
            raise ValueError(f"Round: skip {self.skip} exceeds unet {self.unet}; only stepping UNet tasks skip CFG")
        if self.unet == 0 and self.vae == 0:
            raise ValueError("Round: a round runs at least one UNet or VAE task, got (0, 0, 0)")

    def __str__(self) -> str:
        return f"(m={self.unet}, n={self.vae}, k={self.skip})"


@dataclass(frozen=True)
class ConcurrencyTable:
    """T_cost^c(m, n, k) for one VAE chunking granularity c (§III-C): per profiled round, its
    concurrent latency tau (seconds, the whole round) and delta (seconds from the round's start
    until its VAE work is done; 0 when it decodes nothing).

    The paper's V(t) adds delta to the start of the stage, so a decode must finish within its
    round: 0 <= delta <= tau. Rows exist only within the profiled bounds, unet <= B_max.
    """

    entries: Mapping[Round, tuple[float, float]] = field(hash=False)  # {Round: (tau, delta)}
    chunks: int  # c
    max_batch: int  # B_max

    def __post_init__(self) -> None:
        check_int("ConcurrencyTable", "chunks", self.chunks, 1)
        check_int("ConcurrencyTable", "max_batch", self.max_batch, 1)
        if not isinstance(self.entries, Mapping):
            raise ValueError(f"ConcurrencyTable: entries must be a mapping {{Round: (tau, delta)}}, "
                             f"got {type(self.entries).__name__}")
        if not self.entries:
            raise ValueError(f"ConcurrencyTable (c={self.chunks}): the table has no rows")
        frozen: dict[Round, tuple[float, float]] = {}
        for key, value in self.entries.items():
            if not isinstance(key, Round):
                raise ValueError(f"ConcurrencyTable: keys must be Round, got {key!r}")
            owner = f"ConcurrencyTable row {key}"
            if key.unet > self.max_batch:
                raise ValueError(f"{owner}: unet {key.unet} exceeds max_batch {self.max_batch}")
            if not isinstance(value, tuple) or len(value) != 2:
                raise ValueError(f"{owner}: value must be a (tau, delta) tuple, got {value!r}")
            tau, delta = value
            check_number(owner, "tau", tau, 0.0, low_open=True)
            check_number(owner, "delta", delta, 0.0, tau)
            if key.vae == 0 and delta != 0:
                raise ValueError(f"{owner}: delta must be 0 in a round that decodes nothing, got {delta!r}")
            frozen[key] = (float(tau), float(delta))
        # A read-only copy: the caller's dict may change later, the table must not.
        object.__setattr__(self, "entries", MappingProxyType(frozen))

    def __reduce__(self) -> tuple[type[ConcurrencyTable], tuple[dict[Round, tuple[float, float]], int, int]]:
        # A mappingproxy cannot be pickled, and tables travel between processes (Ray actors).
        return (type(self), (dict(self.entries), self.chunks, self.max_batch))

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, int, int, float, float]], chunks: int,
                  max_batch: int) -> ConcurrencyTable:
        """Build from plain (m, n, k, tau, delta) tuples; converting text is the reader's job."""
        entries: dict[Round, tuple[float, float]] = {}
        for row in rows:
            if not isinstance(row, (tuple, list)) or len(row) != 5:
                raise ValueError(f"ConcurrencyTable.from_rows: a row is (m, n, k, tau, delta), got {row!r}")
            m, n, k, tau, delta = row
            key = Round(m, n, k)
            if key in entries:
                # Two measurements of one round: which one the planner sees must not be an accident.
                raise ValueError(f"ConcurrencyTable.from_rows: round {key} appears twice")
            entries[key] = (tau, delta)
        return cls(entries, chunks, max_batch)

    def has(self, round_: Round) -> bool:
        return round_ in self.entries

    def tau(self, round_: Round) -> float:
        return self._row(round_)[0]

    def delta(self, round_: Round) -> float:
        return self._row(round_)[1]

    def rounds(self) -> tuple[Round, ...]:
        """Every profiled round, in (unet, vae, skip) order."""
        return tuple(sorted(self.entries))

    def _row(self, round_: Round) -> tuple[float, float]:
        try:
            return self.entries[round_]
        except KeyError:
            raise KeyError(f"round {round_} is not in the c={self.chunks} table "
                           f"(B_max={self.max_batch}, {len(self.entries)} rows)") from None


@dataclass(frozen=True)
class SequencePlan:
    """An execution sequence S = [(m_1, n_1, k_1), ..., (m_T, n_T, k_T)] (§III-D).

    vae_cost: J without the 1/N and the constant U_i - A_i terms of Eq. 3a, i.e. the sum over
    VAE tasks of V(t) (Eq. 3b), their completion times measured from the start of the sequence.
    seconds: the sequence's length, the sum of its rounds' tau (the left side of Eq. 3f).
    """

    rounds: tuple[Round, ...]
    vae_cost: float
    seconds: float

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, tuple) or not all(isinstance(r, Round) for r in self.rounds):
            raise ValueError(f"SequencePlan: rounds must be a tuple of Round, got {self.rounds!r}")
        check_number("SequencePlan", "vae_cost", self.vae_cost, 0.0)
        check_number("SequencePlan", "seconds", self.seconds, 0.0)

    @property
    def unet(self) -> int:
        return sum(r.unet for r in self.rounds)

    @property
    def vae(self) -> int:
        return sum(r.vae for r in self.rounds)

    @property
    def skip(self) -> int:
        return sum(r.skip for r in self.rounds)
