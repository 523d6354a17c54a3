"""The application graph: Ingress → Router (→ denoiser workers) → TextEncoder, and VAEDecoder.

`build_app(args)` is used from Python and from Serve YAML (`import_path:
stepserve.deployments.app:build_app`, `args:` holding an `AppConfig`).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from ..actors.coserve_router import CoServeRouter
from ..actors.router import Router
from .config import COSERVE_POLICY, AppConfig, ComponentConfig
from .ingress import Ingress
from .text_encoder import TextEncoder
from .vae_decoder import VAEDecoder

# Every in-flight image holds a call open on the ingress and the router for its whole life;
# the router's own queue bound (router.max_queue_len → 429) is what sheds load.
LONG_CALLS = 100_000


def _actor_options(component: ComponentConfig) -> dict[str, Any]:
    return {"num_cpus": component.num_cpus, "num_gpus": component.num_gpus}


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    sources = [m.to_source() for m in config.models]

    te = config.text_encoder
    text_encoder = serve.deployment(TextEncoder, name="TextEncoder").options(
        num_replicas=te.num_replicas, max_ongoing_requests=max(64, 4 * te.max_batch_size),
        ray_actor_options=_actor_options(te),
    ).bind(sources, te.device, te.torch_threads, te.max_batch_size, te.batch_wait_timeout_s, te.cache_size)

    # Videos decode on the worker that holds them (GenServe: decode does not benefit from SP).
    vd = config.vae_decoder
    image_sources = [m.to_source() for m in config.models if not m.is_video]
    vae_decoder = serve.deployment(VAEDecoder, name="VAEDecoder").options(
        num_replicas=vd.num_replicas, max_ongoing_requests=16, ray_actor_options=_actor_options(vd),
    ).bind(image_sources, vd.device, vd.torch_threads)

    rc = config.router
    options = {"num_replicas": 1, "max_ongoing_requests": LONG_CALLS, "ray_actor_options": {"num_cpus": 0}}
    if rc.policy == COSERVE_POLICY:
        router = serve.deployment(CoServeRouter, name="Router").options(**options).bind(
            sources, config.workers.to_spec(), config.genserve_config(), tuple(rc.profiles),
            {m.name: m.slo_s for m in config.models}, rc.max_queue_len, text_encoder)
    else:
        router = serve.deployment(Router, name="Router").options(**options).bind(
            sources, config.workers.to_spec(), rc.policy, rc.policy_options, rc.max_queue_len, text_encoder,
            rc.pipeline_depth)

    ing = config.ingress
    return serve.deployment(Ingress, name="Ingress").options(
        num_replicas=ing.num_replicas, max_ongoing_requests=LONG_CALLS, ray_actor_options=_actor_options(ing),
    ).bind(config, router, vae_decoder)
