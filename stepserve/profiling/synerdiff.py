"""SynerDiff's offline profiler (§III-C), measured on this device for one served model: what a
round costs when a denoising step and VAE decode chunks run at once, as a worker with a decode
lane runs them (the step in one thread, the chunks in another: `engine.decode_lane`).

1. B_max: the step alone for 1..`--max-batch` requests (CFG rows), the smallest batch within 5%
   of the best throughput (`saturation_batch`).
2. c: for each chunking c, c rounds of a step of B_max/2 requests beside one chunk of one decode
   (t_u^i, t_v^i of Eq. 2); L(c) (Eq. 1, lambda `--lam`) against the step and the whole decode
   alone picks c among 1..C_max (`choose_chunks`, `max_chunks`).
3. The table T_cost^c(m, n, k) at that c: every round of m <= B_max steps (k of them without their
   unconditional row) beside n <= m decode chunks, and the decode-only rounds (0, n, 0):
   tau, the round's wall time, and delta, when its chunks were done.

    stepserve profile-concurrency --out docs/results/synerdiff-profile

Writes concurrency.csv (the model, its size, c, m, n, k, tau_s, delta_s: `ConcurrencyTable.from_rows`),
concurrency.json (B_max, the chunk timings, L(c), c, C_max) and concurrency.png.

On CUDA (`--device`, default: the config's `workers.device`) the chunks run on a stream of their
own, as the decode lane runs them, and every clock is read once the work it times is done on
the GPU (each lane waits for its own stream, so the two still overlap).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from stepserve.policies.synerdiff import (
    ChunkTiming,
    ConcurrencyTable,
    choose_chunks,
    chunk_cost,
    max_chunks,
    saturation_batch,
)
from stepserve.profiling.common import first_timestep, forward_inputs, log, set_threads


class Rounds:
    """One model's concurrent rounds: a step of m requests (k skipping CFG) in this thread,
    beside n decode chunks in another, both started together."""

    def __init__(self, family, size: int):
        from stepserve.engine.text_encoding import embed

        self.family, self.size = family, size
        self.text = embed(family, "a red circle on a white background")
        self.t = first_timestep(family, size)
        self.generator = torch.Generator("cpu").manual_seed(0)
        side = size // family.vae_scale_factor
        self.latents = torch.randn(1, family.latent_channels, side, side, generator=self.generator).to(family.device)
        self._inputs: dict[int, tuple] = {}
        self.cuda = torch.device(family.device).type == "cuda"
        self.lane_stream = torch.cuda.Stream(device=family.device) if self.cuda else None

    def step(self, m: int, k: int) -> None:
        rows = 2 * m - k
        if rows not in self._inputs:
            self._inputs[rows] = forward_inputs(self.family, self.text, self.t, rows, self.size, self.generator)
        self.family.denoise(*self._inputs[rows])

    def chunks(self, n: int, chunks: int, index: int) -> list:
        """n decodes advanced to chunk `index` of `chunks`, ready to run their next one."""
        decodes = [self.family.decode_in_chunks(self.latents, chunks) for _ in range(n)]
        for decode in decodes:
            for _ in range(index):
                decode.step()
        return decodes

    def round(self, m: int, k: int, decodes: list) -> tuple[float, float, float]:
        """(the round's seconds, when its chunks were done, when its step was done)."""
        done = {}

        def decode_chunks():
            with torch.inference_mode(), _on(self.lane_stream):
                for decode in decodes:
                    decode.step()
                if self.lane_stream is not None:
                    self.lane_stream.synchronize()
            done["vae"] = time.perf_counter()

        if self.cuda:
            torch.cuda.synchronize(self.family.device)  # the chunks' inputs, made on the default stream
        start = time.perf_counter()
        lane = threading.Thread(target=decode_chunks) if decodes else None
        if lane is not None:
            lane.start()
        if m:
            self.step(m, k)
        if self.cuda:
            torch.cuda.current_stream(self.family.device).synchronize()
        done["unet"] = time.perf_counter()
        if lane is not None:
            lane.join()
        end = max(done.values())
        return end - start, done.get("vae", start) - start, done["unet"] - start


def median_round(rounds: Rounds, m: int, n: int, k: int, chunks: int, repeats: int) -> tuple[float, float, float]:
    """Medians over `repeats` rounds, the decodes' chunk index cycling through the decode."""
    samples = []
    for i in range(repeats + 1):
        decodes = rounds.chunks(n, chunks, i % chunks)
        samples.append(rounds.round(m, k, decodes))
    samples = samples[1:]  # the first warms up
    return tuple(statistics.median(s[j] for s in samples) for j in range(3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve profile-concurrency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from stepserve.runtime import default_config_path

    parser.add_argument("--config", default=str(default_config_path()), help="Serve YAML: model and threads")
    parser.add_argument("--model", help="model name from the config (default: its first)")
    parser.add_argument("--size", type=int, help="square size, px (default: the model's default size)")
    parser.add_argument("--max-batch", type=int, default=8, help="largest batch measured (default: 8)")
    parser.add_argument("--most-chunks", type=int, default=6, help="finest chunking tried (default: 6)")
    parser.add_argument("--lam", type=float, default=0.5, help="L(c)'s weight (the paper's 0.5)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", help="torch device (default: the config's workers.device)")
    parser.add_argument("--out", type=Path, default=Path("results/synerdiff-profile"))
    args = parser.parse_args(argv)

    from stepserve.deployments.config import AppConfig
    from stepserve.engine.families import ALL_PARTS, load_family
    from stepserve.engine.round_sequencer import PROFILE_COLUMNS
    from stepserve.load_tests.plots import plot_concurrency
    from stepserve.runtime import load_serve_config

    started = time.perf_counter()
    app = AppConfig.model_validate(load_serve_config(args.config)["applications"][0].get("args", {}))
    model = app.model(args.model)
    if model is None or model.is_video:
        print(f"error: {args.model!r} is not an image model of {args.config}", file=sys.stderr)
        return 2
    size = args.size or int(model.default_size.split("x")[0])
    threads = set_threads(app.workers.torch_threads)
    device = args.device or app.workers.device
    family = load_family(model.to_source(), ALL_PARTS, device)
    with torch.inference_mode():
        rounds = Rounds(family, size)
        log(f"[B_max] the step alone, 1..{args.max_batch} requests, {size} px, {threads} thread(s)")
        solo = {m: median_round(rounds, m, 0, 0, 1, args.repeats)[0] for m in range(1, args.max_batch + 1)}
        b_max = saturation_batch(solo)
        decode_alone = statistics.median(
            _timed(lambda: family.decode_in_chunks(rounds.latents, 1).run(), rounds.cuda) for _ in range(args.repeats))
        batch = max(1, b_max // 2)
        log(f"[c] {batch} requests beside one decode in 1..{args.most_chunks} chunks")
        timings = []
        for c in range(1, args.most_chunks + 1):
            per_round = [rounds.round(batch, 0, rounds.chunks(1, c, i)) for i in range(c)]
            timings.append(ChunkTiming(c, tuple(r[2] for r in per_round), tuple(r[1] for r in per_round)))
        chunks = choose_chunks(timings, solo[batch], decode_alone, args.lam)
        ceiling = max_chunks(timings, solo[batch])
        log(f"[table] c = {chunks}: every (m <= {b_max}, n <= m, k <= m) round")
        rows = []
        for m in range(0, b_max + 1):
            for n in range(0, (b_max if m == 0 else m) + 1):
                for k in range(0, m + 1):
                    if m or n:
                        tau, delta, _ = median_round(rounds, m, n, k, chunks, args.repeats)
                        rows.append((chunks, m, n, k, tau, delta if n else 0.0))
    table = ConcurrencyTable.from_rows([r[1:] for r in rows], chunks, b_max)  # checks every row
    report = {"benchmark": "synerdiff_profile", "model": model.name, "size": size, "threads": threads,
              "device": torch.cuda.get_device_name(device) if rounds.cuda else "cpu", "dtype": str(family.dtype),
              "step_alone_s": solo, "b_max": b_max, "decode_alone_s": decode_alone, "timing_batch": batch,
              "chunk_timings": [{"chunks": t.chunks, "unet_s": t.unet, "vae_s": t.vae,
                                 "cost": chunk_cost(t, solo[batch], decode_alone, args.lam)} for t in timings],
              "chunks": chunks, "max_chunks": ceiling, "table_rows": len(table.rounds()),
              "wall_s": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "concurrency.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(PROFILE_COLUMNS)
        writer.writerows((model.name, size, size, *row) for row in rows)
    (args.out / "concurrency.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_concurrency(report, rows, f"concurrent rounds, {model.name} at {size} px, {threads} thread(s) a lane",
                     args.out / "concurrency.png")
    print(f"B_max {b_max}; c = {chunks} by L(c) (C_max {ceiling}); {len(rows)} rounds in the table; "
          f"wrote {args.out}")
    return 0


def _timed(fn, cuda: bool) -> float:
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _on(stream):
    """The lane's CUDA stream as a context (nothing on the CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


if __name__ == "__main__":
    sys.exit(main())
