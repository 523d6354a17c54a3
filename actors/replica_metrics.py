"""The ingress replicas' metrics, summed in one place.

Each ingress replica has its own Prometheus registry, and a scrape of `/metrics` reaches one
replica of several: published per replica, a counter would jump between replicas' values from
one scrape to the next. So each replica pushes what its registry holds (cumulative counts,
`snapshot`) to the router, which keeps every replica's latest push and publishes their sum
(`ReplicaSums`, a collector in its registry). A replica that stops (scaled down, restarted)
keeps its last counts in the sum, so no counter ever goes back while the router lives.

Only counters and histograms add up across replicas; a gauge does not, and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

ADDITIVE = ("counter", "histogram")
# Labels as sorted (name, value) pairs: hashable, and equal for equal label sets.
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class FamilySnapshot:
    """One metric family of a replica's registry: its name, help, type and samples (sample name,
    labels, value), without the `_created` samples (a creation time, which does not add up)."""

    name: str
    documentation: str
    type: str
    samples: tuple[tuple[str, Labels, float], ...]


def snapshot(registry: CollectorRegistry) -> tuple[FamilySnapshot, ...]:
    """What `registry` holds now, to push; raises ValueError for a family that is not additive."""
    families = []
    for family in registry.collect():
        if family.type not in ADDITIVE:
            raise ValueError(f"metric {family.name} is a {family.type}: only counters and histograms add up "
                             "across ingress replicas")
        samples = tuple((s.name, tuple(sorted(s.labels.items())), float(s.value))
                        for s in family.samples if not s.name.endswith("_created"))
        families.append(FamilySnapshot(family.name, family.documentation, family.type, samples))
    return tuple(families)


class ReplicaSums:
    """Every replica's latest snapshot, and their sum as a Prometheus collector."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[int, tuple[FamilySnapshot, ...]]] = {}

    def update(self, replica: str, sequence: int, families: tuple[FamilySnapshot, ...]) -> None:
        """A replica's push; `sequence` orders its pushes (one that arrives after a later one is dropped)."""
        held = self._latest.get(replica)
        if held is None or sequence > held[0]:
            self._latest[replica] = (sequence, families)

    @property
    def replicas(self) -> int:
        return len(self._latest)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, tuple[FamilySnapshot, dict[tuple[str, Labels], float]]] = {}
        for _, families in self._latest.values():
            for family in families:
                known = merged.get(family.name)
                if known is not None and known[0].type != family.type:
                    continue  # another version of the ingress typed it otherwise: keep the first
                _, sums = merged.setdefault(family.name, (family, {}))
                for name, labels, value in family.samples:
                    sums[name, labels] = sums.get((name, labels), 0.0) + value
        for family, sums in merged.values():
            metric = Metric(family.name, family.documentation, family.type)
            for (name, labels), value in sums.items():
                metric.add_sample(name, dict(labels), value)
            yield metric
