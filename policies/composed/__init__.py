"""The composed policy: GenServe's spine with the other seeds' scheduling mechanisms as
switchable components (policy.py)."""

from stepserve.policies.composed.policy import ComposedPolicy
from stepserve.policies.composed.types import ComposedConfig

__all__ = ["ComposedConfig", "ComposedPolicy"]
