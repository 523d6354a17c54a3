"""`stepserve serve` runs a Serve config locally; `stepserve generate` makes one image;
`stepserve profile` measures this device's latencies into a cost-model profile CSV."""

from __future__ import annotations

import argparse
import base64
import signal
import sys
import time
import uuid
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from stepserve.runtime import load_serve_config, run_app, start_local_ray

    config = load_serve_config(args.config)
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


def _generate(args: argparse.Namespace) -> int:
    import ray
    from ray import serve
    from tqdm import tqdm

    from stepserve.deployments.config import AppConfig
    from stepserve.deployments.errors import APIError
    from stepserve.deployments.validation import to_specs
    from stepserve.runtime import load_serve_config, run_app, start_local_ray

    request = {"prompt": args.prompt, "n": 1}
    for key in ("model", "size", "negative_prompt", "num_inference_steps", "guidance_scale", "seed"):
        if getattr(args, key) is not None:
            request[key] = getattr(args, key)
    config = load_serve_config(args.config)
    try:  # fail fast, before paying for a Ray start; the server validates again
        (spec,) = to_specs(request, AppConfig.model_validate(config["applications"][0]["args"]), "cli")
    except APIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    request["seed"] = spec.seed
    start_local_ray(args.num_cpus)
    try:
        print("starting stepserve (in-process)...", file=sys.stderr)
        handle = run_app(config, http=False)
        request_id = f"cli-{uuid.uuid4().hex[:12]}"
        response = handle.generate.remote(request, request_id)
        with tqdm(desc="denoising", unit="step", total=spec.steps_to_run) as bar:
            while True:
                try:
                    result = response.result(timeout_s=0.1)
                    break
                except TimeoutError:
                    progress = handle.progress.remote(request_id).result()
                    if progress:
                        bar.update(progress["steps_done"] - bar.n)
            bar.update(bar.total - bar.n)
    except APIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        serve.shutdown()
        ray.shutdown()
    image = result["data"][0]
    Path(args.output).write_bytes(base64.b64decode(image["b64_json"]))
    print(f"wrote {args.output} (seed {image['seed']})")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from stepserve.profile import run_profile  # torch and Ray load only when profiling

    return run_profile(args)


PASS_THROUGH = (
    ("simulate", "stepserve.load_tests.sim.__main__", "discrete-event simulation of a workload (see --help)"),
    ("compare", "stepserve.load_tests.compare_policies", "simulated policy comparison report (see --help)"),
    ("bench", "stepserve.load_tests.bench_batching", "live benchmark: continuous vs static batching (see --help)"),
    ("lora-bound", "stepserve.load_tests.bench_lora_bound",
     "how late a LoRA may join, and the fidelity of joining late (see --help)"),
)


def main(argv: list[str] | None = None) -> int:
    from stepserve.runtime import default_config_path

    parser = argparse.ArgumentParser(prog="stepserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="start a lean local Ray and serve a config until Ctrl-C")
    serve_p.add_argument("config", nargs="?", default=str(default_config_path()), help="Serve YAML")
    serve_p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    serve_p.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="generate one image in-process and write it as PNG")
    gen.add_argument("prompt")
    gen.add_argument("-o", "--output", default="out.png")
    gen.add_argument("--config", default=str(default_config_path()), help="Serve YAML")
    gen.add_argument("--model")
    gen.add_argument("--size", help="WIDTHxHEIGHT")
    gen.add_argument("--negative-prompt", dest="negative_prompt")
    gen.add_argument("--steps", dest="num_inference_steps", type=int)
    gen.add_argument("--guidance-scale", dest="guidance_scale", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    gen.set_defaults(func=_generate)

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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
