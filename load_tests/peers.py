"""What users deploy instead of stepserve: the benchmark's peers.

Ray Serve's Stable Diffusion example pattern: a FastAPI ingress deployment in front of a model
deployment that calls the diffusers pipeline once per request (`per_request`), or once per
`@serve.batch` of requests that share size, steps and guidance (`batched`). Same weights (the
model entry of a stepserve config, built by the same preset builder or loaded from the same
folder), same OpenAI route and body, same PNG encoding, so the same load generator drives it
and the images are the ones stepserve's exact path makes.

A pipeline keeps its scheduler's step counter as shared state, and Serve runs a sync method in
a thread pool: two calls at once on one pipeline would step each other's scheduler and return
wrong images. So `per_request` replicas take one call at a time (`max_ongoing_requests=1`, the
rest wait at the ingress's handle), and a `batched` replica runs one batch at a time.

    build_peer_app({"model": {...}, "mode": "batched"})   # or import_path in a Serve YAML
"""

# No `from __future__ import annotations`: FastAPI must see real annotations on the route.
import asyncio
import base64
import secrets
import time
from typing import Any, Literal

import numpy as np
import torch
from diffusers import MultiControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve import Application

from stepserve.deployments.config import AddonConfig, LimitsConfig, ModelConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.image_inputs import decode_base64_image
from stepserve.deployments.protocol import ImageGenerationRequest
from stepserve.engine.addons.source import AddonKind, controlnet_model
from stepserve.engine.png import encode_png
from stepserve.engine.families import ALL_PARTS, load_family

GENERATIONS = "/v1/images/generations"
CONTROLNET_PIPELINES = {"sd15": StableDiffusionControlNetPipeline, "sdxl": StableDiffusionXLControlNetPipeline}


class PeerConfig(BaseModel):
    model_config = {"extra": "forbid"}

    model: ModelConfig = Field(description="The model to serve, as in a stepserve config's `models` list.")
    mode: Literal["per_request", "batched"] = Field(
        description="per_request: one pipeline call per request; batched: one call per @serve.batch group.")
    num_replicas: int = Field(default=2, ge=1, description="Model replicas (stepserve's local layout: 2 workers).")
    num_cpus: float = Field(default=0.5, gt=0, description="CPUs per model replica.")
    torch_threads: int = Field(default=1, ge=1, description="torch threads per model replica.")
    max_batch_size: int = Field(default=8, ge=1, description="batched: most requests per pipeline call.")
    batch_wait_timeout_s: float = Field(default=0.5, ge=0, description="batched: how long a batch waits to fill.")
    ingress_num_cpus: float = Field(default=0.1, ge=0, description="CPUs of the ingress replica.")
    controlnets: list[AddonConfig] = Field(
        default_factory=list, description="per_request: ControlNets held by each replica and run before its UNet.")
    loras: list[AddonConfig] = Field(
        default_factory=list, description="per_request: LoRA files, loaded into the pipeline for each request that "
                                          "uses them (load_lora_weights + fuse_lora, unfused and unloaded after).")


class Rejected(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def parse(body: Any, model: ModelConfig) -> dict[str, Any]:
    """The pipeline arguments of a request body, checked against the model's limits."""
    try:
        req = ImageGenerationRequest.model_validate(body)
    except ValidationError as exc:
        raise Rejected(400, exc.errors()[0]["msg"]) from None
    if req.model not in (None, model.name):
        raise Rejected(404, f"model {req.model!r} is not served", "model")
    if req.n != 1:
        raise Rejected(400, "n must be 1", "n")
    size = model.default_size if req.size in (None, "auto") else req.size
    try:
        width, height = (int(side) for side in size.split("x"))
    except ValueError:
        raise Rejected(400, f"size must be WIDTHxHEIGHT, got {size!r}", "size") from None
    if not (model.min_size <= min(width, height) and max(width, height) <= model.max_size) or width % 8 or height % 8:
        raise Rejected(400, f"size {size} is out of range", "size")
    steps = model.default_steps if req.num_inference_steps is None else req.num_inference_steps
    if not 1 <= steps <= model.max_steps:
        raise Rejected(400, f"num_inference_steps must be in 1..{model.max_steps}", "num_inference_steps")
    guidance = model.default_guidance_scale if req.guidance_scale is None else req.guidance_scale
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    try:
        controlnets = [(c.name, decode_base64_image(c.image, "image", LimitsConfig()), c.conditioning_scale, c.start,
                        c.end) for c in req.controlnets or ()]
    except APIError as exc:
        raise Rejected(exc.status, exc.message, exc.param) from None
    return {"prompt": req.prompt, "negative_prompt": req.negative_prompt, "width": width, "height": height,
            "num_inference_steps": steps, "guidance_scale": guidance, "seed": seed, "controlnets": controlnets,
            "loras": [(lora.name, lora.scale) for lora in req.loras or ()]}


class PipelineModel:
    """The model deployment's pipeline: one call for one or more requests of one shape."""

    def __init__(self, model: ModelConfig, torch_threads: int):
        torch.set_num_threads(torch_threads)
        self.family = load_family(model.to_source(), ALL_PARTS, "cpu")

    def run(self, requests: list[dict[str, Any]]) -> list[bytes]:
        head = requests[0]
        negatives = [r["negative_prompt"] or "" for r in requests]
        images = self.family.pipe(
            prompt=[r["prompt"] for r in requests],
            negative_prompt=negatives if any(negatives) else None,
            width=head["width"], height=head["height"], num_inference_steps=head["num_inference_steps"],
            guidance_scale=head["guidance_scale"],
            generator=[torch.Generator().manual_seed(r["seed"]) for r in requests], output_type="np",
        ).images
        return [encode_png(image) for image in images]


class PerRequestPeer(PipelineModel):
    def __init__(self, model: ModelConfig, torch_threads: int, controlnets: list[AddonConfig] = (),
                 loras: list[AddonConfig] = ()):
        super().__init__(model, torch_threads)
        self.controlnets = {c.name: controlnet_model(c.to_source(AddonKind.CONTROLNET), model.to_source())
                            for c in controlnets}
        self.lora_paths = {lora.name: lora.path for lora in loras}

    def generate(self, request: dict[str, Any]) -> bytes:
        if request["controlnets"] or request["loras"]:
            return encode_png(image_with_addons(self.family, self.controlnets, self.lora_paths, request))
        return self.run([request])[0]


def image_with_addons(family: Any, controlnets: dict[str, Any], lora_paths: dict[str, str],
                      request: dict[str, Any]) -> np.ndarray:
    """One image with add-ons, the diffusers way (SwiftDiffusion's DIFFUSERS baseline): its LoRAs
    read from their files and fused into the UNet (`load_lora_weights`, `set_adapters`,
    `fuse_lora`), its ControlNets run before the UNet at every step by the ControlNet pipeline
    (`MultiControlNetModel` for several), the LoRAs unfused and unloaded after. `family.pipe`'s
    UNet is changed while this runs."""
    pipe = family.pipe
    names = [name for name, _ in request["loras"]]
    if names:
        for name in names:
            pipe.load_lora_weights(lora_paths[name], adapter_name=name)
        pipe.set_adapters(names, adapter_weights=[scale for _, scale in request["loras"]])
        pipe.fuse_lora(adapter_names=names)
    try:
        extra: dict[str, Any] = {}
        uses = request["controlnets"]
        if uses:
            one = (lambda xs: xs) if len(uses) > 1 else (lambda xs: xs[0])
            cls = CONTROLNET_PIPELINES[family.source.family]
            components = {k: v for k, v in pipe.components.items() if k in cls._get_signature_keys(cls)[0]}
            nets = [controlnets[name] for name, *_ in uses]
            quiet = {"requires_safety_checker": False} if family.source.family == "sd15" else {}
            pipe = cls(**components, controlnet=nets[0] if len(nets) == 1 else MultiControlNetModel(nets), **quiet)
            pipe.set_progress_bar_config(disable=True)
            extra = dict(image=one([u[1] for u in uses]), controlnet_conditioning_scale=one([u[2] for u in uses]),
                         control_guidance_start=one([u[3] for u in uses]),
                         control_guidance_end=one([u[4] for u in uses]))
        with torch.inference_mode():
            return pipe(
                request["prompt"], negative_prompt=request["negative_prompt"] or None, height=request["height"],
                width=request["width"], num_inference_steps=request["num_inference_steps"],
                guidance_scale=request["guidance_scale"], generator=torch.Generator("cpu").manual_seed(request["seed"]),
                output_type="np", **extra,
            ).images[0]
    finally:
        if names:
            family.pipe.unfuse_lora()
            family.pipe.unload_lora_weights()


def shape_of(request: dict[str, Any]) -> tuple:
    return request["width"], request["height"], request["num_inference_steps"], request["guidance_scale"]


class BatchedPeer(PipelineModel):
    def __init__(self, model: ModelConfig, torch_threads: int, max_batch_size: int, batch_wait_timeout_s: float):
        super().__init__(model, torch_threads)
        self.generate_batch.set_max_batch_size(max_batch_size)
        self.generate_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def generate(self, request: dict[str, Any]) -> bytes:
        if request["controlnets"] or request["loras"]:
            raise ValueError("the batched peer serves no add-ons (one pipeline call serves one adapter set)")
        return await self.generate_batch(request)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.5)
    async def generate_batch(self, requests: list[dict[str, Any]]) -> list[bytes]:
        # One pipeline call per shape in the batch; requests of another shape cannot share one.
        out: list[bytes | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(shape_of(request), []).append(i)
        for members in groups.values():
            # Off the event loop, so the replica still takes requests into the next batch.
            pngs = await asyncio.to_thread(self.run, [requests[i] for i in members])
            for i, png in zip(members, pngs):
                out[i] = png
        return out


api = FastAPI()


@serve.ingress(api)
class PeerIngress:
    def __init__(self, model: ModelConfig, handle: Any):
        self.model = model
        self.handle = handle

    @api.get("/ready")
    async def ready(self) -> dict[str, str]:
        return {"status": "ready"}

    @api.post(GENERATIONS)
    async def generations(self, http: Request) -> Any:
        try:
            try:
                body = await http.json()
            except ValueError:
                raise Rejected(400, "the body is not JSON") from None
            request = parse(body, self.model)
        except Rejected as exc:
            return JSONResponse({"error": {"message": exc.message, "type": "invalid_request_error",
                                           "param": exc.param, "code": None}}, status_code=exc.status)
        png = await self.handle.generate.remote(request)
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode(),
                                                        "seed": request["seed"]}]}


def model_deployment(config: PeerConfig) -> Application:
    """The model deployment of the peer, bound (the ingress's handle goes to it)."""
    options = {"num_replicas": config.num_replicas, "ray_actor_options": {"num_cpus": config.num_cpus}}
    if config.mode == "per_request":
        return serve.deployment(PerRequestPeer, name="PerRequestPeer").options(
            max_ongoing_requests=1, **options).bind(config.model, config.torch_threads, config.controlnets,
                                                    config.loras)
    return serve.deployment(BatchedPeer, name="BatchedPeer").options(
        max_ongoing_requests=4 * config.max_batch_size, **options,
    ).bind(config.model, config.torch_threads, config.max_batch_size, config.batch_wait_timeout_s)


def build_peer_app(args: dict[str, Any] | PeerConfig) -> Application:
    config = args if isinstance(args, PeerConfig) else PeerConfig.model_validate(args)
    return serve.deployment(PeerIngress, name="PeerIngress").options(
        max_ongoing_requests=100_000, ray_actor_options={"num_cpus": config.ingress_num_cpus},
    ).bind(config.model, model_deployment(config))
