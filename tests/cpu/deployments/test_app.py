"""The application graph `build_app` binds: every deployment, and the options each gets."""

from __future__ import annotations

from ray.serve.deployment import Application

from stepserve.deployments.app import build_app
from stepserve.runtime import tiny_config_path, load_serve_config

METRICS_ENV = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"
ONE_LOOP_ENV = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
ROUTER_LOOP_ENV = "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"


def deployments(app: Application) -> dict[str, object]:
    """Name -> deployment, for every deployment reachable from the ingress."""
    found, todo = {}, [app]
    while todo:
        deployment = todo.pop()._bound_deployment
        if deployment.name not in found:
            found[deployment.name] = deployment
            todo += [a for a in (*deployment.init_args, *deployment.init_kwargs.values()) if isinstance(a, Application)]
    return found


def app_args(**changes) -> dict:
    args = dict(load_serve_config(tiny_config_path())["applications"][0]["args"])
    return {**args, **changes}


def test_every_deployment_exports_serves_metrics_at_the_configured_interval():
    graph = deployments(build_app(app_args(text_encoder={"on_workers": False}, vae_decoder={"on_workers": False})))
    assert set(graph) == {"Ingress", "Router", "TextEncoder", "VAEDecoder", "JobStore"}
    for name, deployment in graph.items():
        assert deployment.ray_actor_options["runtime_env"]["env_vars"][METRICS_ENV] == "1000", name

    graph = deployments(build_app(app_args(serve_metrics_export_ms=250)))
    assert {d.ray_actor_options["runtime_env"]["env_vars"][METRICS_ENV] for d in graph.values()} == {"250"}


def test_serves_defaults_leave_the_environment_alone():
    graph = deployments(build_app(app_args(serve_metrics_export_ms=None, serve_one_loop=False,
                                           text_encoder={"on_workers": False}, vae_decoder={"on_workers": False})))
    for name, deployment in graph.items():
        assert "runtime_env" not in deployment.ray_actor_options, name


def test_the_control_plane_runs_on_one_loop_and_the_model_deployments_keep_serves_threads():
    graph = deployments(build_app(app_args(text_encoder={"on_workers": False}, vae_decoder={"on_workers": False})))
    one_loop = {ONE_LOOP_ENV: "0", ROUTER_LOOP_ENV: "0"}
    for name in ("Ingress", "Router", "JobStore"):
        env = graph[name].ray_actor_options["runtime_env"]["env_vars"]
        assert {k: env.get(k) for k in one_loop} == one_loop, name
    for name in ("TextEncoder", "VAEDecoder"):  # their model calls block: never on Serve's own loop
        env = graph[name].ray_actor_options["runtime_env"]["env_vars"]
        assert not set(one_loop) & set(env), name

    graph = deployments(build_app(app_args(serve_one_loop=False)))
    for name, deployment in graph.items():
        assert not set(one_loop) & set(deployment.ray_actor_options["runtime_env"]["env_vars"]), name


def test_only_the_ingress_writes_an_access_log():
    graph = deployments(build_app(app_args()))
    assert graph["Router"].logging_config["enable_access_log"] is False
    assert graph["JobStore"].logging_config["enable_access_log"] is False
    assert graph["Ingress"].logging_config is None  # Serve's default: one access-log line per client request


def test_resources_are_the_configs():
    graph = deployments(build_app(app_args(ingress={"num_cpus": 0.2},
                                           text_encoder={"num_cpus": 0.3, "num_gpus": 0, "on_workers": False})))
    assert graph["Ingress"].ray_actor_options["num_cpus"] == 0.2
    assert graph["TextEncoder"].ray_actor_options["num_cpus"] == 0.3
    assert graph["Router"].ray_actor_options["num_cpus"] == 0
    assert graph["JobStore"].ray_actor_options["num_cpus"] == 0


def test_workers_that_decode_images_replace_the_decoder_deployment():
    graph = deployments(build_app(app_args(vae_decoder={"on_workers": False})))
    assert "VAEDecoder" in graph
    _, pool, spec, _, decoder, _ = graph["Router"].init_args
    assert not pool.decode_images and not spec.core.images_decode_on_workers
    assert isinstance(decoder, Application)

    graph = deployments(build_app(app_args(text_encoder={"on_workers": False}, vae_decoder={"on_workers": True})))
    assert set(graph) == {"Ingress", "Router", "TextEncoder", "JobStore"}
    _, pool, spec, _, decoder, _ = graph["Router"].init_args
    # The workers load the VAE and return PNGs; the router predicts each last plan with its decode.
    assert pool.decode_images and spec.core.images_decode_on_workers and decoder is None


def test_workers_that_encode_prompts_replace_the_text_encoder_deployment():
    graph = deployments(build_app(app_args(text_encoder={"on_workers": False, "cache_size": 7})))
    assert "TextEncoder" in graph
    _, pool, spec, encoder, _, _ = graph["Router"].init_args
    assert not pool.encode_text and not spec.core.text_encode_on_workers
    assert isinstance(encoder, Application)
    assert graph["TextEncoder"].init_args[-1] == 7  # its cache

    graph = deployments(build_app(app_args(text_encoder={"on_workers": True, "cache_size": 7})))
    assert "TextEncoder" not in graph
    _, pool, spec, encoder, _, _ = graph["Router"].init_args
    # The workers load the text encoders, each with the configured cache; the router predicts
    # each admitting plan with its encoding, and the ingress checks no text encoder for /ready.
    assert pool.encode_text and pool.text_cache_size == 7 and spec.core.text_encode_on_workers and encoder is None
    assert graph["Ingress"].init_args[3] is None  # its text encoder
