"""Policies by name, so configs and the simulator can pick one with a string and a dict.

A registered class is either a `Scheduler` (it has `schedule`) or a `WorkerPolicy` (it has
`plan`), which `make_policy` wraps in `PerWorker`. A class that predicts step times sets
`needs_costs = True` and is built as `cls(config, costs)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from stepserve.policies.base import PerWorker, Scheduler

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
        if not (hasattr(policy_cls, "schedule") or hasattr(policy_cls, "plan")):
            raise TypeError(f"policy {name!r}: {policy_cls!r} has neither schedule() nor plan()")
        # What the router may do around the policy's plans (see `Scheduler`): said, not guessed.
        declared = ("steady", "joins_running", "splits_cfg") if hasattr(policy_cls, "schedule") else ("joins_running",)
        missing = [a for a in declared if not isinstance(getattr(policy_cls, a, None), bool)]
        if missing:
            raise TypeError(f"policy {name!r}: {policy_cls!r} must declare {' and '.join(missing)} (a bool class "
                            "attribute; see policies.base.Scheduler)")
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


def make_policy(name: str, options: dict[str, Any] | None = None, costs: Any = None) -> Scheduler:
    """Build the named policy as a `Scheduler`; every error is a ValueError that says what to fix.

    `costs` (a `StepCosts`) is handed to policies that predict step times and required by them.
    """
    policy_cls, _ = _lookup(name)
    config = validate_policy(name, options)
    if needs_costs(name):
        if costs is None:
            raise ValueError(f"policy {name!r} predicts step times: it needs latency profiles (router.profiles)")
        policy = policy_cls(config, costs)
    else:
        policy = policy_cls(config)
    return policy if hasattr(policy, "schedule") else PerWorker(policy)


def validate_policy(name: str, options: dict[str, Any] | None = None) -> Any:
    """The named policy's config built from `options` (a config file is checked with it before
    anything is deployed); ValueError says what to fix."""
    _, config_cls = _lookup(name)
    options = dict(options or {})
    valid = [f.name for f in dataclasses.fields(config_cls) if f.init]
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise ValueError(
            f"policy {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(valid) or '(none)'}"
        )
    if "sp_degrees" in options and isinstance(options["sp_degrees"], list):
        options["sp_degrees"] = tuple(options["sp_degrees"])  # YAML has no tuples
    try:
        return config_cls(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {name!r}: invalid options: {exc}") from exc


def options_for(name: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The entries of another policy's `options` that the named policy takes (a config whose
    policy is swapped for a benchmark keeps, say, the composed policy's spine options for
    `genserve`, whose fields they are, and drops its own switches)."""
    valid = {f.name for f in dataclasses.fields(_lookup(name)[1]) if f.init}
    return {key: value for key, value in (options or {}).items() if key in valid}


def options_for_workers(name: str, options: dict[str, Any] | None, max_batch_size: int,
                        pack_resolutions: bool = False) -> dict[str, Any]:
    """`options` as the router builds the named policy over workers that batch up to
    `max_batch_size` requests and, with `pack_resolutions`, run several resolutions in one
    forward: a policy that forms image batches itself forms them up to that cap, and packs
    them where the workers do, unless told otherwise. The served app and the simulator both
    build their policy from this, so a simulated run batches as the served one does."""
    options = dict(options or {})
    fields = {f.name for f in dataclasses.fields(_lookup(name)[1]) if f.init}
    if "image_max_batch" in fields:
        options.setdefault("image_max_batch", max_batch_size)
    if "pack_resolutions" in fields:
        options.setdefault("pack_resolutions", pack_resolutions)
    return options


def needs_costs(name: str) -> bool:
    """Whether the named policy predicts step times from a cost model."""
    return bool(getattr(_lookup(name)[0], "needs_costs", False))


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[type, type]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(policy_names())}"
        ) from None


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
