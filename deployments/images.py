"""`POST /v1/images/generations` and `/v1/images/edits` behind the ingress: validate, admit,
submit, answer.

A request may carry a client id (the `Idempotency-Key` header, or `request_id` through a handle):
its requests are named after it, so a retry while the first attempt runs joins it (the router
returns the same images to both), and a retry after it finished gets the stored response from
the job store (kept under the same TTL and byte budget as videos). A retry with another body
is a 409. Without an id every call is a new request.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid
from typing import Any

import ray

from stepserve.actors.router_core import DuplicateRequestError
from stepserve.deployments.config import AppConfig
from stepserve.deployments.edge import AdmissionGate, as_api_error
from stepserve.deployments.image_inputs import control_inputs
from stepserve.deployments.jobs import IdempotencyConflict
from stepserve.deployments.edit_validation import parse_edit, to_edit_specs
from stepserve.deployments.protocol import ImageEditRequest, ImageGenerationRequest
from stepserve.deployments.validation import parse_request, to_specs
from stepserve.engine.sampler import RequestInputs
from stepserve.deployments.videos import key_seed, request_digest
from stepserve.policies.types import RequestSpec


class ImageRequests:
    def __init__(self, config: AppConfig, router: Any, store: Any, gate: AdmissionGate, stages: Any):
        self.config = config
        self.router = router
        self.store = store
        self.gate = gate
        self.stages = stages  # a Histogram by stage name: `HTTPMetrics.image_stage`

    async def generate(self, payload: ImageGenerationRequest | dict, client_id: str | None = None) -> dict:
        """The OpenAI images response body. Raises APIError."""
        started = time.perf_counter()
        req = parse_request(payload)
        rid = request_id_for(client_id)
        specs = to_specs(req, self.config, rid, default_seed=key_seed(client_id))
        # Control images are decoded and resized off the event loop; they wait in the object
        # store (not in the router's memory) for the worker that admits the request.
        control = await asyncio.to_thread(control_inputs, req, specs[0].width, specs[0].height, self.config.limits) \
            if req.controlnets else ()
        inputs = RequestInputs(control=control) if control else None
        return await self._serve(rid, specs, inputs, request_digest(req), client_id, started)

    async def edit(self, payload: ImageEditRequest | dict, client_id: str | None = None) -> dict:
        """POST /v1/images/edits: the OpenAI images response body. Raises APIError."""
        started = time.perf_counter()
        req = parse_edit(payload)
        rid = request_id_for(client_id)
        # Decoding, checking and resizing the image and mask is CPU work: off the event loop.
        specs, inputs = await asyncio.to_thread(to_edit_specs, req, self.config, rid, key_seed(client_id))
        return await self._serve(rid, specs, inputs, request_digest(req), client_id, started)

    async def _serve(self, rid: str, specs: list[RequestSpec], inputs: RequestInputs | None, digest: str,
                     client_id: str | None, started: float) -> dict:
        """Admit, submit and answer the specs of request `rid` (its `n` images)."""
        refs = [ray.put(inputs)] if inputs is not None else None
        try:
            if client_id is not None:
                stored = await self.store.image_for.remote(client_id, digest)
                if stored is not None:
                    return stored
            for spec in specs:
                self.gate.check(spec.kind.lane, rid)
            submitted = time.perf_counter()
            pngs = await asyncio.gather(*(self.router.submit.remote(spec, refs) for spec in specs))
            answered = time.perf_counter()
        except BaseException as exc:
            # Free the siblings of a failed request (a disconnect cancels them all already). A
            # duplicate id belongs to another caller's live request, which must not be cancelled.
            if not isinstance(exc, (asyncio.CancelledError, DuplicateRequestError, IdempotencyConflict)):
                for spec in specs:
                    self.router.cancel.remote(spec.request_id)
            raise as_api_error(exc, rid) from None
        body = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode(), "seed": spec.seed} for spec, png in zip(specs, pngs)],
        }
        if client_id is not None:
            await self.store.remember_image.remote(client_id, digest, body)
        for stage, seconds in (("validate", submitted - started), ("router", answered - submitted),
                               ("respond", time.perf_counter() - answered)):
            self.stages.labels(stage).observe(seconds)
        return body


def request_id_for(client_id: str | None) -> str:
    """A request's id: derived from the client's id (so retries meet), else fresh."""
    if client_id is None:
        return f"img-{uuid.uuid4().hex}"
    return f"img-{hashlib.sha256(client_id.encode()).hexdigest()[:32]}"
