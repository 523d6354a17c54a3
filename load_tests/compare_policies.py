"""The issue's policy comparison, simulated: several policies on one workload at several rates.

    python -m stepserve.load_tests.compare_policies --workload synerdiff-mixed --profile sd15-a100 \
        --workers 8 --rates 1,2,3,4,5 --policies static_fcfs,dynamic_batching,continuous \
        --out results/policies

Every policy sees exactly the same requests at each rate (same seed, same cluster). Writes
<out>/policies.json (one summary per policy and rate), <out>/policies_vs_load.png (SLO
attainment, goodput and P95 latency against offered load), <out>/policies_bars.png (the
policies side by side at each rate) and <out>/policies_latency_cdf.png (one panel per rate).
"""

from __future__ import annotations

import argparse
import json
import sys

from stepserve.load_tests.sweep import (add_sim_args, config_from_args, load_cost, print_table, run_sweep,
                                        sweep_report, workload_from_args, write_outputs)
from stepserve.policies.registry import validate_policy

BASELINES = ("static_fcfs", "dynamic_batching", "continuous")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.compare_policies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_args(parser)
    parser.add_argument("--policies", default=",".join(BASELINES),
                        help="comma-separated registry names, in plot order (default: %(default)s)")
    parser.add_argument("--policy-options", type=json.loads, default={},
                        help='per-policy configs as JSON, e.g. \'{"dynamic_batching": {"window_s": 0.5}}\'')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:  # bad workload, profile, policy or option
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:  # fail before hours of simulation, not after
        validate_policy(policy, args.policy_options.get(policy))
    spec = workload_from_args(args)
    config = config_from_args(args)
    cost = load_cost(args.profile)
    rates = args.rates or [spec.mean_rate]
    runs = run_sweep(spec, cost, config, policies, rates, args.policy_options)
    report = sweep_report("policy_comparison", spec, args.profile, config, runs, args.traces)
    title = (f"{spec.name} on {args.profile}: {config.workers} workers, batch cap {config.max_batch_size}, "
             f"SLO {spec.slo_scale:g}x solo" if spec.slo_scale else f"{spec.name} on {args.profile}")
    written = write_outputs(args.out, "policies", report, runs, title)
    print_table(runs)
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
