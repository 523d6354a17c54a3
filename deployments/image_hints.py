"""OpenAI image parameters that steer OpenAI's own service and not these models (`moderation`,
`style`, `input_fidelity`, the end-user ids `user` and `safety_identifier`): accepted, so the
official clients work unchanged, and recorded, so an operator sees who asks for what. They never
change an image.

Recorded as one INFO line per request on the logger "stepserve.images", keyed by the request id,
and as counts by parameter and value in `/metrics` (`hints_counter`, on the ingress's registry).
End-user ids are logged, not counted: a label per user would grow without bound.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter

logger = logging.getLogger("stepserve.images")

COUNTED = ("moderation", "style", "input_fidelity")  # closed sets of values (Literal in the protocol)
RECORDED = COUNTED + ("user", "safety_identifier")


def hints_counter(registry: CollectorRegistry) -> Counter:
    return Counter("stepserve_image_hints", "Image requests by the value of a parameter that does not change the "
                   "image here (moderation, style, input_fidelity), counted when a request gives it.",
                   ["param", "value"], registry=registry)


def record_hints(req: Any, request_id: str, counter: Counter) -> None:
    """Log (and count) the recorded parameters `req` gives; requests that give none log nothing."""
    given = {name: getattr(req, name, None) for name in RECORDED}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return
    # %r: a client's text may hold newlines, which must not start a forged log line.
    logger.info("image request %s: %s", request_id, " ".join(f"{name}={value!r}" for name, value in given.items()))
    for name in COUNTED:
        if name in given:
            counter.labels(name, given[name]).inc()
