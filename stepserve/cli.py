"""`stepserve serve` runs a Serve config locally; `stepserve generate` makes one image, in this
process with the server's engine (no Ray cluster, no Serve) or, with --url, on a running server;
`stepserve profile` measures this device's latencies into a cost-model profile CSV."""

from __future__ import annotations

import argparse
import base64
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from stepserve.runtime import load_serve_config, run_app, start_local_ray

    config = load_serve_config(args.config)
    if args.host is not None:
        config["http_options"] = {**(config.get("http_options") or {}), "host": args.host}
    # Ctrl-C ends in the `finally` below, which shuts Serve and Ray down, also when it comes
    # while the app is still deploying (the proxy can answer /ready before serve.run returns).
    # SIGINT is reset because a shell may start background jobs with it ignored. (SIGTERM is
    # Ray's: its native failure handler aborts the driver, and Ray offers no switch for that.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    http = config.get("http_options") or {}
    try:
        start_local_ray(args.num_cpus)
        run_app(config, http=True)
        print(f"stepserve is up on http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)} (Ctrl-C to stop)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    return 0


# How long `generate --url` waits for its image: a busy server queues it behind others.
REMOTE_TIMEOUT_S = 600.0


def _generate(args: argparse.Namespace) -> int:
    request = {"prompt": args.prompt}
    for key in ("model", "size", "negative_prompt", "num_inference_steps", "guidance_scale", "seed", "step_cache",
                "step_cache_method", "skip_cfg_quality"):
        if getattr(args, key) is not None:
            request[key] = getattr(args, key)
    if args.url is not None:
        return _generate_remote(args, request)
    return _generate_here(args, request)


def _generate_here(args: argparse.Namespace, request: dict) -> int:
    """One image in this process (`stepserve.oneshot`): the server's engine, no Ray cluster, no Serve."""
    from stepserve.deployments.errors import APIError
    from stepserve.oneshot import app_config, gc_paused, generate, quiet_libraries, validate
    from stepserve.runtime import load_serve_config

    # Both entered before validation, which imports the engine: transformers warns as it loads.
    with gc_paused(), quiet_libraries():
        app = app_config(load_serve_config(args.config))
        try:  # fail fast, before the model loads
            spec = validate(app, request)
        except APIError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        from tqdm import tqdm

        with tqdm(desc="denoising", unit="step", total=spec.steps_to_run) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            png = generate(app, spec, progress)
    Path(args.output).write_bytes(png)
    print(f"wrote {args.output} (seed {spec.seed})")
    return 0


def _generate_remote(args: argparse.Namespace, request: dict) -> int:
    """The same request to a running server (`stepserve serve`), which validates and answers it."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {**request, "n": 1, "response_format": "b64_json"}
    try:
        response = httpx.post(f"{args.url.rstrip('/')}/v1/images/generations", json=body, headers=headers,
                              timeout=REMOTE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        print(f"error: {args.url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if response.status_code >= 400:
        print(f"error: {_error_text(response)}", file=sys.stderr)
        return 2 if response.status_code < 500 else 1  # 4xx: the request was wrong, as a local check says
    image = response.json()["data"][0]
    Path(args.output).write_bytes(base64.b64decode(image["b64_json"]))
    print(f"wrote {args.output} (seed {image['seed']})")
    return 0


def _error_text(response: httpx.Response) -> str:
    """The server's error as `APIError` prints it, from OpenAI's error shape where it has one."""
    from stepserve.deployments.errors import APIError

    try:
        error = response.json()["error"]
        return str(APIError(response.status_code, error["message"], param=error.get("param"),
                            code=error.get("code"), type=error.get("type")))
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}: {response.text[:500]}"


def _profile(args: argparse.Namespace) -> int:
    from stepserve.profiling.images import run_profile  # torch and Ray load only when profiling

    return run_profile(args)


PASS_THROUGH = (
    ("simulate", "stepserve.load_tests.sim.__main__", "discrete-event simulation of a workload (see --help)"),
    ("compare", "stepserve.load_tests.compare_policies", "simulated policy comparison report (see --help)"),
    ("bench", "stepserve.load_tests.bench_batching", "live benchmark: continuous vs static batching (see --help)"),
    ("train-shapes", "stepserve.train_shapes",
     "train the shipped shapes models from scratch on this machine (see --help)"),
    ("lora-bound", "stepserve.load_tests.bench_lora_bound",
     "how late a LoRA may join, and the fidelity of joining late (see --help)"),
    ("profile-concurrency", "stepserve.profiling.synerdiff",
     "SynerDiff's offline profiler: concurrent step + VAE-chunk rounds, c by L(c), B_max (see --help)"),
)


def main(argv: list[str] | None = None) -> int:
    from stepserve.runtime import default_config_path

    parser = argparse.ArgumentParser(prog="stepserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="start a lean local Ray and serve a config until Ctrl-C")
    serve_p.add_argument("config", nargs="?", default=str(default_config_path()), help="Serve YAML")
    serve_p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    serve_p.add_argument("--host", default=None, help="address HTTP listens on (default: the config's; a "
                                                      "container's: 0.0.0.0)")
    serve_p.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="make one image with the server's engine in this process (no Ray, no "
                                          "Serve), or with --url on a running server, and write it as PNG")
    gen.add_argument("prompt")
    gen.add_argument("-o", "--output", default="out.png")
    gen.add_argument("--config", default=str(default_config_path()), help="Serve YAML")
    gen.add_argument("--model")
    gen.add_argument("--size", help="WIDTHxHEIGHT")
    gen.add_argument("--negative-prompt", dest="negative_prompt")
    gen.add_argument("--steps", dest="num_inference_steps", type=int)
    gen.add_argument("--guidance-scale", dest="guidance_scale", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--step-cache", dest="step_cache", type=float,
                     help="First-Block Cache threshold (0: exact; default: the model's; README 'Step caching')")
    gen.add_argument("--step-cache-method", dest="step_cache_method", choices=("first_block", "taylorseer"),
                     help="what a skipped step takes (default: the model's)")
    gen.add_argument("--skip-cfg-quality", dest="skip_cfg_quality", type=float,
                     help="SynerDiff's skip-CFG quality S (1: exact; default: the model's; README 'SynerDiff')")
    gen.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000) to ask instead; --config is unused")
    gen.add_argument("--api-key", default=os.environ.get("STEPSERVE_API_KEY"),
                     help="bearer token for --url (default: $STEPSERVE_API_KEY)")
    gen.set_defaults(func=_generate, exit_at_once=True)

    prof = sub.add_parser("profile", help="measure this device's latency grid and write a profile CSV")
    prof.add_argument("--model", help="model name from the config (default: its first model)")
    prof.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    prof.add_argument("--config", default=str(default_config_path()), help="Serve YAML: model, threads, app")
    prof.add_argument("--out", help="CSV to write (default: configs/profiles/<model>-<device>.csv)")
    prof.add_argument("--quick", action="store_true", help="a tiny grid and no live app (for tests)")
    prof.add_argument("--live", action=argparse.BooleanOptionalAction, default=None,
                      help="measure request_overhead on the config's live app (default: on unless --quick)")
    prof.add_argument("--sizes", type=int, nargs="+", help="square sizes in px (overrides the grid)")
    prof.add_argument("--host-probe", action=argparse.BooleanOptionalAction, default=None,
                      help="on CPU, measure how busy cores slow each other (default: on, off with --quick)")
    prof.add_argument("--batches", type=int, nargs="+", help="requests per forward (overrides the grid)")
    prof.add_argument("--repeats", type=int, help="timed repeats per point (overrides the grid)")
    prof.add_argument("--mask-ratios", type=float, nargs="*",
                      help="where the model edits with cached activations, the mask ratios (in (0, 1)) its masked "
                           "forwards are measured at (default: 0.1 0.2 0.5; none given: not measured)")
    prof.add_argument("--num-cpus", type=int, default=None, help="CPUs the local Ray may use (default: all)")
    prof.set_defaults(func=_profile)

    # Benchmarks keep their own argument parsers; these subcommands hand the rest of the line on.
    for name, module, help_text in PASS_THROUGH:
        sub.add_parser(name, help=help_text, add_help=False).set_defaults(module=module)

    args, rest = parser.parse_known_args(argv)
    if hasattr(args, "module"):
        import importlib

        return importlib.import_module(args.module).main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    code = args.func(args)
    if argv is None and getattr(args, "exit_at_once", False):
        # This process is the command itself, and it is done: the interpreter's teardown of the
        # torch and diffusers modules it imported takes over a second and does nothing for it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
