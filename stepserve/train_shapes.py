"""`stepserve train-shapes`: train the shipped shapes models from scratch on this machine's CPUs
and write them where the embedded default loads them (configs/models/shapes), deterministically
by seed."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    from stepserve.engine.shapes.export import SHIPPED

    parser = argparse.ArgumentParser(prog="stepserve train-shapes", description=__doc__)
    parser.add_argument("--out", default=str(SHIPPED), help="folder to write (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="everything is deterministic given it")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--vae-from", help="an earlier run's folder (same seed and VAE schedule): take its VAE, the "
                                           "first stage, instead of training it again")
    args = parser.parse_args(argv)

    import torch

    from stepserve.engine.shapes.export import train_all
    from stepserve.engine.shapes.training import ShapesTraining

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    record = train_all(args.out, ShapesTraining(args.seed), vae_from=args.vae_from)
    stages = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in record["seconds"].items())
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s ({stages})")
    return 0
