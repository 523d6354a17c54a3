"""`POST /v1/images/generations` and `/v1/images/edits` behind the ingress: validate, admit,
submit, answer (in the file format the request asks for: `image_output`).

A request may carry a client id (the `Idempotency-Key` header, or `request_id` through a handle):
its requests are named after it, so a retry while the first attempt runs joins it (the router
returns the same images to both), and a retry after it finished gets the stored response from
the job store (kept under the same TTL and byte budget as videos). A retry with another body
is a 409. Without an id every call is a new request.

A router that dies holding an image (it restarts) loses it: the ingress still has its spec and
inputs, and submits it again to the next router, for up to `ROUTER_RESTART_WAIT_S`. The image is
denoised again from its start, with its seed: the same picture.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
import uuid
from typing import Any

import ray
from prometheus_client import Counter

from stepserve.deployments.config import AppConfig
from stepserve.deployments.edge import AdmissionGate, as_api_error
from stepserve.deployments.edit_validation import parse_edit, to_edit_specs
from stepserve.deployments.image_hints import record_hints
from stepserve.deployments.image_inputs import control_inputs
from stepserve.deployments.image_output import ImageOutput, encode_all, output_for
from stepserve.deployments.jobs import IdempotencyConflict
from stepserve.deployments.protocol import ImageEditRequest, ImageGenerationRequest
from stepserve.deployments.validation import parse_request, to_specs
from stepserve.deployments.videos import key_seed, request_digest
from stepserve.engine.sampler import RequestInputs
from stepserve.policies.types import RequestSpec
from stepserve.routing.core import DuplicateRequestError

logger = logging.getLogger("stepserve.images")
# How long an image waits for a router that died holding it to come back (models reload first).
ROUTER_RESTART_WAIT_S = 300.0
RESUBMIT_PAUSE_S = 1.0


class ImageRequests:
    def __init__(self, config: AppConfig, router: Any, store: Any, gate: AdmissionGate, stages: Any,
                 hints: Counter):
        self.config = config
        self.router = router
        self.store = store
        self.gate = gate
        self.stages = stages  # a Histogram by stage name: `HTTPMetrics.image_stage`
        self.hints = hints  # a Counter from `image_hints.hints_counter`

    async def generate(self, payload: ImageGenerationRequest | dict, client_id: str | None = None) -> dict:
        """The OpenAI images response body. Raises APIError."""
        started = time.perf_counter()
        req = parse_request(payload)
        output = output_for(req)
        rid = request_id_for(client_id)
        specs = to_specs(req, self.config, rid, default_seed=key_seed(client_id))
        record_hints(req, rid, self.hints)
        # Control images are decoded and resized off the event loop; they wait in the object
        # store (not in the router's memory) for the worker that admits the request.
        control = await asyncio.to_thread(control_inputs, req, specs[0].width, specs[0].height, self.config.limits) \
            if req.controlnets else ()
        inputs = RequestInputs(control=control) if control else None
        return await self._serve(rid, specs, inputs, output, request_digest(req), client_id, started)

    async def edit(self, payload: ImageEditRequest | dict, client_id: str | None = None,
                   owner: str | None = None) -> dict:
        """POST /v1/images/edits: the OpenAI images response body. Raises APIError. `owner`: the
        caller's tenant, whose templates are its own."""
        started = time.perf_counter()
        req = parse_edit(payload)
        output = output_for(req)  # before the costly decoding below
        rid = request_id_for(client_id)
        # Decoding, checking and resizing the image and mask is CPU work: off the event loop.
        specs, inputs = await asyncio.to_thread(to_edit_specs, req, self.config, rid, key_seed(client_id), owner)
        record_hints(req, rid, self.hints)
        return await self._serve(rid, specs, inputs, output, request_digest(req), client_id, started)

    async def _serve(self, rid: str, specs: list[RequestSpec], inputs: RequestInputs | None, output: ImageOutput,
                     digest: str, client_id: str | None, started: float) -> dict:
        """Admit, submit and answer the specs of request `rid` (its `n` images) in `output`'s format."""
        refs = [ray.put(inputs)] if inputs is not None else None
        try:
            if client_id is not None:
                stored = await self.store.image_for.remote(client_id, digest)
                if stored is not None:
                    return stored
            await self.gate.admit(specs[0].kind.lane, rid, len(specs))
            submitted = time.perf_counter()
            pngs = await asyncio.gather(*(self._submit(spec, refs) for spec in specs))
            answered = time.perf_counter()
        except BaseException as exc:
            # Free the siblings of a failed request (a disconnect cancels them all already). A
            # duplicate id belongs to another caller's live request, which must not be cancelled.
            if not isinstance(exc, (asyncio.CancelledError, DuplicateRequestError, IdempotencyConflict)):
                for spec in specs:
                    self.router.cancel.remote(spec.request_id)
            raise as_api_error(exc, rid) from None
        # Transcoding is CPU work: off the event loop (png needs none: its bytes go out as decoded).
        files = pngs if output.format == "png" else await asyncio.to_thread(encode_all, pngs, output)
        body = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(f).decode(), "seed": spec.seed} for spec, f in zip(specs, files)],
            **output.fields(specs[0]),
        }
        if client_id is not None:
            await self.store.remember_image.remote(client_id, digest, body)
        for stage, seconds in (("validate", submitted - started), ("router", answered - submitted),
                               ("respond", time.perf_counter() - answered)):
            self.stages.labels(stage).observe(seconds)
        return body

    async def _submit(self, spec: RequestSpec, refs: list | None) -> bytes:
        """Its PNG from the router; submitted again when the router dies holding it."""
        deadline = time.monotonic() + ROUTER_RESTART_WAIT_S
        while True:
            try:
                return await self.router.submit.remote(spec, refs, self.gate.id)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                if time.monotonic() >= deadline:
                    raise
                logger.warning("the router died holding %s (%s): submitting it again", spec.request_id,
                               type(exc).__name__)
                await asyncio.sleep(RESUBMIT_PAUSE_S)


def request_id_for(client_id: str | None) -> str:
    """A request's id: derived from the client's id (so retries meet), else fresh."""
    if client_id is None:
        return f"img-{uuid.uuid4().hex}"
    return f"img-{hashlib.sha256(client_id.encode()).hexdigest()[:32]}"
