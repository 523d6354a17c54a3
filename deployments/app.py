"""The application graph: Ingress → Router (→ denoiser workers, LoRA stores → ControlNetService)
→ TextEncoder, VAEDecoder, JobStore (no TextEncoder when the workers encode prompts,
`text_encoder.on_workers`; no VAEDecoder when they decode images, `vae_decoder.on_workers`; a
ControlNetService only with `controlnet_service.enabled`; LoRA stores only with LoRAs).

`build_app(args)` is used from Python and from Serve YAML (`import_path:
stepserve.deployments.app:build_app`, `args:` holding an `AppConfig`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve import Application

from stepserve.actors.router import Router, RouterSpec
from stepserve.deployments.config import AppConfig, ComponentConfig
from stepserve.deployments.controlnet_service import ControlNetService
from stepserve.deployments.api_access import ApiAccess
from stepserve.deployments.ingress import Ingress
from stepserve.deployments.job_store import JobStore
from stepserve.deployments.text_encoder import TextEncoder
from stepserve.deployments.vae_decoder import VAEDecoder
from stepserve.engine.addons.source import AddonKind

# Every in-flight image holds a call open on the ingress and the router for its whole life, and
# every video status long poll (`Prefer: wait`) one on the job store; admission
# (router.max_queued_*, shed at the ingress with 429) and jobs.max_jobs are what bound them.
LONG_CALLS = 100_000


# The router and the job store are only ever called by the app itself: a Serve access-log line
# per call (a submit, a plan's store call) is noise to an operator and costs a log write, and
# Ray's log monitor forwarding it. The ingress keeps its log of client requests.
INTERNAL_LOGGING = {"enable_access_log": False}


def actor_options(config: AppConfig, num_cpus: float, num_gpus: float = 0,
                  control_plane: bool = True) -> dict[str, Any]:
    """A deployment's `ray_actor_options`: its resources and the Serve settings of its replicas'
    environment (`AppConfig.replica_env`)."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    env = config.replica_env(control_plane)
    if env:
        # Merged with the application's runtime_env (these keys win).
        options["runtime_env"] = {"env_vars": env}
    return options


def _model_options(config: AppConfig, component: ComponentConfig) -> dict[str, Any]:
    return actor_options(config, component.num_cpus, component.num_gpus, control_plane=False)


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    sources = [m.to_source() for m in config.models]

    te = config.text_encoder
    text_encoder = None if te.on_workers else serve.deployment(TextEncoder, name="TextEncoder").options(
        num_replicas=te.num_replicas, max_ongoing_requests=max(64, 4 * te.max_batch_size),
        ray_actor_options=_model_options(config, te),
    ).bind(sources, te.device, te.torch_threads, te.max_batch_size, te.batch_wait_timeout_s, te.cache_size)

    # Videos decode on the worker that holds them (GenServe: decode does not benefit from SP);
    # images too when `vae_decoder.on_workers`, and then there is no decoder deployment.
    vd = config.vae_decoder
    image_sources = [m.to_source() for m in config.models if not m.is_video]
    vae_decoder = None if vd.on_workers else serve.deployment(VAEDecoder, name="VAEDecoder").options(
        num_replicas=vd.num_replicas, max_ongoing_requests=16, ray_actor_options=_model_options(config, vd),
    ).bind(image_sources, vd.device, vd.torch_threads)

    # One replica, apart from the router: a router restart loses no finished job; its own writes
    # through to `jobs.storage` (its default folder is named here, once a build).
    jobs = config.jobs
    store = serve.deployment(JobStore, name="JobStore").options(
        num_replicas=1, max_ongoing_requests=LONG_CALLS, ray_actor_options=actor_options(config, 0),
        logging_config=INTERNAL_LOGGING,
    ).bind(jobs.ttl_s, jobs.max_bytes, jobs.max_jobs, jobs.journal_spec())

    cs = config.controlnet_service
    controlnets = None if not (cs.enabled and config.controlnets) else serve.deployment(
        ControlNetService, name="ControlNetService").options(
        num_replicas=cs.num_replicas, max_ongoing_requests=cs.max_ongoing_requests,
        ray_actor_options=_model_options(config, cs),
    ).bind([a.to_source(AddonKind.CONTROLNET) for a in config.controlnets], sources, cs.device, cs.torch_threads,
           cs.cache_size)

    rc = config.router
    core = replace(rc.core_config(), images_decode_on_workers=vd.on_workers, text_encode_on_workers=te.on_workers,
                   lora_batches=config.lora_loading.batches, lora_resident=config.lora_loading.max_resident,
                   cached_edits=config.edit_cache.enabled)
    spec = RouterSpec(rc.policy, config.policy_options(), tuple(rc.profiles), core, cs.placement)
    pool = config.pool_spec()
    router = serve.deployment(Router, name="Router").options(
        num_replicas=1, max_ongoing_requests=LONG_CALLS, ray_actor_options=actor_options(config, 0),
        logging_config=INTERNAL_LOGGING,
    ).bind(sources, pool, spec, text_encoder, vae_decoder, store, controlnet_service=controlnets)

    ing = config.ingress
    return serve.deployment(Ingress, name="Ingress").options(
        num_replicas=ing.num_replicas, max_ongoing_requests=LONG_CALLS,
        ray_actor_options=actor_options(config, ing.num_cpus, ing.num_gpus),
    ).bind(config, router, store, text_encoder, ApiAccess.of(config))  # keys resolved here, digests only
