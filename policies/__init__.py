"""Scheduling policies: pure functions of a `ClusterSnapshot`, picked by name.

Importing this package registers every policy, so `make_policy(name)` works after a plain
`import stepserve.policies`.
"""

from stepserve.policies.base import PerWorker, PolicyError, Scheduler, WorkerPolicy
from stepserve.policies.registry import (
    make_policy,
    needs_costs,
    options_for,
    options_for_workers,
    policy_names,
    register_policy,
)
from stepserve.policies.types import (
    ClusterSnapshot,
    Decision,
    RequestFailure,
    RequestKind,
    RequestProgress,
    RequestSpec,
    RequestStatus,
    RequestView,
    ShapeKey,
    StepGroup,
    StepReport,
    WorkerPlan,
    WorkerView,
)

# Imported for their registration side effect.
from stepserve.policies import continuous, dynamic_batching, latent_parallel, static_fcfs  # noqa: E402,F401  isort: skip
from stepserve.policies.composed import policy as composed_policy  # noqa: E402,F401  isort: skip
from stepserve.policies.genserve import policy as genserve_policy  # noqa: E402,F401  isort: skip
from stepserve.policies.instgenie import placement as instgenie_placement  # noqa: E402,F401  isort: skip
from stepserve.policies.patchedserve import scheduler as patchedserve_scheduler  # noqa: E402,F401  isort: skip

__all__ = [
    "ClusterSnapshot",
    "Decision",
    "PerWorker",
    "PolicyError",
    "RequestFailure",
    "RequestKind",
    "RequestProgress",
    "RequestSpec",
    "RequestStatus",
    "RequestView",
    "Scheduler",
    "ShapeKey",
    "StepGroup",
    "StepReport",
    "WorkerPlan",
    "WorkerPolicy",
    "WorkerView",
    "make_policy",
    "needs_costs",
    "options_for",
    "options_for_workers",
    "policy_names",
    "register_policy",
]
