"""Stores kept one per node (LoRA weights, templates' activations): started on every live node
at once, and found by the workers of each node."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def start_per_node(cls: type, name: str, args_for: Callable[[str], tuple], **options: Any) -> dict[str, Any]:
    """One actor of `cls` per live node, by node id, pinned there, restarted when it dies, named
    `<name>-<node>-<token>` (the token keeps a restarted router's stores apart from the ones its
    predecessor is still tearing down); `args_for(node_id)`: its constructor's arguments."""
    remote_cls = ray.remote(cls)
    token = uuid.uuid4().hex[:8]
    stores = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        stores[node_id] = remote_cls.options(
            name=f"{name}-{node_id[:8]}-{token}", num_cpus=0, max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options,
        ).remote(*args_for(node_id))
    return stores


def stores_by_node(stores: Mapping[str, Any], node_id: str) -> Any:
    """The store on `node_id`, else any (a node that has none shares another's over the network)."""
    return stores.get(node_id) or next(iter(stores.values()))
