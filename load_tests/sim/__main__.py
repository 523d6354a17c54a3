"""Simulate one policy on a workload at one or several offered rates.

    python -m stepserve.load_tests.sim --workload synerdiff-mixed --profile sd15-a100 \
        --workers 8 --policy continuous --rates 1,2,3,4 --out results/sim

Writes <out>/sim.json (workload, cluster, one summary per rate), <out>/sim_latency_cdf.png and,
with several rates, <out>/sim_vs_load.png (SLO attainment, goodput and P95 against load).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from stepserve.load_tests.sweep import (add_sim_args, config_from_args, load_cost, print_table, run_sweep,
                                        sweep_report, workload_from_args, write_outputs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_args(parser)
    parser.add_argument("--policy", default=None, help="scheduling policy by registry name (default: continuous)")
    parser.add_argument("--policy-options", type=json.loads, default=None,
                        help='the policy\'s config as JSON, e.g. \'{"window_s": 0.5}\'')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:  # bad workload, profile, policy or option
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    spec = workload_from_args(args)
    config = config_from_args(args)
    if args.policy is not None and args.policy != config.policy:
        config = replace(config, policy=args.policy, policy_options={})
    if args.policy_options is not None:
        config = replace(config, policy_options=args.policy_options)
    cost = load_cost(args.profile)
    rates = args.rates or [spec.mean_rate]
    runs = run_sweep(spec, cost, config, [config.policy], rates)
    report = sweep_report("simulation", spec, args.profile, config, runs, args.traces)
    title = (f"{spec.name} on {args.profile}: {config.workers} workers, {config.policy}, "
             f"batch cap {config.max_batch_size}")
    written = write_outputs(args.out, "sim", report, runs, title)
    print_table(runs)
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
