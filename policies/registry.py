"""Policies by name, so configs and the simulator can pick one with a string and a dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from stepserve.policies.base import SchedulingPolicy

T = TypeVar("T", bound=type)

# The one piece of module state policies are allowed: filled at import time, read afterwards.
_REGISTRY: dict[str, tuple[type, type]] = {}


def register_policy(name: str, config_cls: type) -> Callable[[T], T]:
    """Class decorator: `policy_cls(config_cls(**options))` becomes available as `name`.

    Sets `policy_cls.name` so the name is written once.
    """
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"config for policy {name!r} must be a dataclass, got {config_cls!r}")

    def decorate(policy_cls: T) -> T:
        previous = _REGISTRY.get(name)
        # Re-running the same module (importlib.reload) is fine; two classes claiming one name
        # is a bug that would otherwise silently pick whichever was imported last.
        if previous is not None and _qualname(previous[0]) != _qualname(policy_cls):
            raise ValueError(
                f"policy name {name!r} already registered by {_qualname(previous[0])}"
            )
        policy_cls.name = name
        _REGISTRY[name] = (policy_cls, config_cls)
        return policy_cls

    return decorate


def make_policy(name: str, options: dict[str, Any] | None = None) -> SchedulingPolicy:
    """Build the named policy; every error is a ValueError that says what to fix."""
    try:
        policy_cls, config_cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(policy_names())}"
        ) from None
    options = dict(options or {})
    valid = [f.name for f in dataclasses.fields(config_cls) if f.init]
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise ValueError(
            f"policy {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(valid) or '(none)'}"
        )
    try:
        config = config_cls(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {name!r}: invalid options: {exc}") from exc
    return policy_cls(config)


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
