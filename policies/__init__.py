"""Scheduling policies: pure functions of a `ClusterSnapshot`, picked by name.

Importing this package registers every policy, so `make_policy(name)` works after a plain
`import stepserve.policies`.
"""

from stepserve.policies.base import PolicyError, SchedulingPolicy
from stepserve.policies.registry import make_policy, policy_names, register_policy
from stepserve.policies.types import (
    ClusterSnapshot,
    RequestProgress,
    RequestSpec,
    RequestStatus,
    RequestView,
    ShapeKey,
    StepReport,
    WorkerPlan,
    WorkerView,
)

# Imported for their registration side effect.
from stepserve.policies import continuous, dynamic_batching, static_fcfs  # noqa: E402,F401  isort: skip

__all__ = [
    "ClusterSnapshot",
    "PolicyError",
    "RequestProgress",
    "RequestSpec",
    "RequestStatus",
    "RequestView",
    "SchedulingPolicy",
    "ShapeKey",
    "StepReport",
    "WorkerPlan",
    "WorkerView",
    "make_policy",
    "policy_names",
    "register_policy",
]
