"""Loading cached activations beside the computation (InstGenIE §4.2, Fig. 9, Algorithm 1): one
masked SD3 transformer forward whose cache lives in host memory, run as each loading plan runs
it, against the same forward with its cache already on the device.

A template's activations are recorded once (`recording_forward`, the same inputs: a self-cache,
so every case must give the exact output; `vs_exact` checks that the loads delivered the right
slots) and pinned in host memory. For each mask ratio the per-slot costs C_w, C_wo and L are
measured (`engine.editing.block_costs`), the DP plans from them, and whole forwards are timed:

- `ideal`: every block uses its cache, already on the device (Fig. 4-left "Ideal");
- `naive`: every block's cache loaded, then the blocks computed (Fig. 9-top; the paper: +102%
  over ideal for SDXL on an H800);
- `always_load`: every block's cache loaded on a side stream beside the computation (Fig.
  9-middle, with its bubbles);
- `algorithm1`, `optimal`: only the blocks `policies.instgenie.pipeline_dp.plan` picks from the
  measured costs load their cache, pipelined; the others compute every token (Fig. 9-bottom);
- `exact`: the plain forward, every token of every block (one case: it does not depend on the
  mask).

The workers serve the same choice (`edit_cache.loading`: `engine.editing.loading_plan`, per
forward, from the block costs `stepserve profile` writes with this module's cost measurement).

`--cache keys_values` runs the same with the keys-and-values record (InstGenIE Fig. 7,
`engine.editing.masked_sd3.CacheKind`): one slot per block (its keys and values: twice a block
output's size, four times in a dual-attention block) and one for the final image tokens, all of
which a keys-values forward must use, so only `ideal`, `naive` and `always_load` exist there (the
DP's choices would compute some blocks in full, which needs the unmasked tokens that forward never
has).

Next to each measured median is the DP's prediction: its pipeline latency plus the forward's
work outside the cache slots (embeddings; the output layer too with cached outputs), taken as
exact - sum(C_wo). Cases are timed round-robin after warmup, every timing synchronized on CUDA.
On CPU with the record in memory nothing is loaded (the cache is where the computation reads it,
L = 0), so every plan is the ideal one. `--host disk` is the CPU node's loading problem: the
record is spilled to the activation store's disk as the store spills it (one safetensors file),
slots are read from it with `engine.editing.record_file.RecordFile` (a background thread reads
ahead for the pipelined plans, `BlockLoader(threaded=True)`), L is a slot's read with its pages
dropped from the page cache, and every case (exact and ideal too) first drops the file's pages,
so each forward reads from the disk as the first edit after a spill does. Weights are random,
built from the config: nothing is downloaded.

    python -m stepserve.load_tests.bench_cache_loading --config tiny --device cpu --out results/cache-loading-cpu
    python -m stepserve.load_tests.bench_cache_loading --host disk --threads 1 --out results/cache-loading-disk
    python -m stepserve.load_tests.bench_cache_loading --config sd3-medium --device cuda --dtype bfloat16 \\
        --out results/cache-loading-gpu
    python -m stepserve.load_tests.bench_cache_loading --config sd3-medium --device cuda --dtype bfloat16 \\
        --cache keys_values --out results/cache-loading-kv-gpu

Writes cache_loading.json and cache_loading.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import save_file
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stepserve.engine.editing.block_costs import BlockCosts, measure_block_costs
from stepserve.engine.editing.block_loader import BlockLoader, pin
from stepserve.engine.editing.masked_sd3 import (
    CacheKind, MaskedPlan, SD3Inputs, masked_forward, plain_forward, recording_forward, token_index,
)
from stepserve.engine.editing.record_file import RecordFile
from stepserve.load_tests.bench_masked_compute import (
    CONFIGS, DTYPES, VAE_SCALE, box_mask, build_transformer, difference, interleaved_times, make_inputs,
)
from stepserve.policies.instgenie.pipeline_dp import Loading, Pipeline, plan
from stepserve.profiling.common import Stopwatch, device_description, log, set_threads

LOADINGS = {
    CacheKind.OUTPUTS: (Loading.IDEAL, Loading.NAIVE, Loading.ALWAYS_LOAD, Loading.ALGORITHM1, Loading.OPTIMAL),
    CacheKind.KEYS_VALUES: (Loading.IDEAL, Loading.NAIVE, Loading.ALWAYS_LOAD),  # every slot loads
}
EXACT = "exact"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_cache_loading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="medium-cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA (random weights overflow float16 more easily)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument("--host", choices=("memory", "disk"), default="memory",
                        help="where the record waits: host memory (copied to a CUDA device; on CPU nothing loads), "
                             "or, on CPU, the activation store's disk (read slot by slot)")
    parser.add_argument("--disk-dir", type=Path, default=None,
                        help="--host disk: the directory to spill the record into (a real disk, not tmpfs; "
                             "default: a temporary directory)")
    parser.add_argument("--cache", choices=[kind.value for kind in CacheKind], default=CacheKind.OUTPUTS.value,
                        help="what the template's record holds: block outputs, or keys and values")
    # sd3-medium on an H100: 16 cases x 12 forwards of 40-100 ms, about 15 s of the whole run.
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cost-repeats", type=int, default=5, help="samples per block cost (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own); 1 is steadier on a shared machine")
    args = parser.parse_args(argv)
    if args.host == "disk" and torch.device(args.device).type != "cpu":
        parser.error("--host disk is the CPU node's loading (a GPU node loads from host memory)")
    return args


def forward_case(transformer: SD3Transformer2DModel, inputs: SD3Inputs, index: torch.Tensor, loading: Loading,
                 use_cache: Sequence[bool], host: list[torch.Tensor] | Callable[[int], torch.Tensor],
                 on_device: list[torch.Tensor], device: torch.device, kind: CacheKind,
                 from_disk: bool) -> Callable[[], torch.Tensor]:
    """One masked forward as `loading` runs it. The loader is made inside the call: every forward
    loads its cache anew, as an edit does. `from_disk`: `host` reads slots from the disk, on a
    thread where the plan is pipelined."""
    if loading is Loading.IDEAL:
        ready = MaskedPlan(index, on_device, use_cache, kind)
        return lambda: masked_forward(transformer, inputs, ready)
    naive = loading is Loading.NAIVE
    threaded = from_disk and not naive
    return lambda: masked_forward(transformer, inputs, MaskedPlan(
        index, BlockLoader(host, use_cache, device, naive, threaded), use_cache, kind))


def spill(record: list[torch.Tensor], disk_dir: Path) -> RecordFile:
    """`record` written as the activation store spills a record (one safetensors file, slot s
    named "s"), synced so its pages are clean and can be dropped, opened for slot reads."""
    path = disk_dir / "record.safetensors"
    save_file({str(s): t for s, t in enumerate(record)}, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return RecordFile(path)


def timed_rounds(cases: dict[Any, Callable[[], Any]], watch: Stopwatch, warmup: int,
                 repeats: int) -> dict[Any, list[float]]:
    """`interleaved_times` one round at a time, logging each (the GPU run has a time limit)."""
    interleaved_times(cases, watch, warmup, 0)
    times: dict[Any, list[float]] = {key: [] for key in cases}
    for r in range(repeats):
        for key, samples in interleaved_times(cases, watch, 0, 1).items():
            times[key] += samples
        log(f"  round {r + 1}/{repeats}: {sum(s[-1] for s in times.values()):.2f} s")
    return times


def case_row(loading: Loading, pipeline: Pipeline, predicted_ideal: float, outside_s: float, samples: list[float],
             ideal_s: float, copied_bytes: Sequence[int], vs_exact: dict[str, float]) -> dict[str, Any]:
    """One case's figures at one mask ratio: measured, predicted, and the slots whose cache it
    takes from host memory or disk (`loads`; `copied_bytes` per slot, 0 on CPU from memory, where
    nothing is copied)."""
    measured = statistics.median(samples)
    predicted = pipeline.latency + outside_s
    loads = [] if loading is Loading.IDEAL else [b for b, use in enumerate(pipeline.use_cache) if use]
    return {"measured_s": measured, "overhead_vs_ideal": measured / ideal_s - 1,
            "predicted_s": predicted, "predicted_blocks_s": pipeline.latency,
            "predicted_overhead_vs_ideal": predicted / (predicted_ideal + outside_s) - 1,
            "use_cache": list(pipeline.use_cache), "loads": loads,
            "loaded_mb": sum(copied_bytes[b] for b in loads) / 2**20, "samples_s": samples, "vs_exact": vs_exact}


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = set_threads(args.threads)
    config = CONFIGS[args.config]
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    log(f"{args.config} on {device_description(args.device)}, {dtype}, {threads} threads: building the transformer")
    transformer = build_transformer(config, device, dtype, args.seed)
    inputs = make_inputs(transformer, config, args.seed)
    kind = CacheKind(args.cache)
    exact, on_device = recording_forward(transformer, inputs, kind)
    slots, patch = len(on_device), transformer.config.patch_size
    tokens = (config.image_size // VAE_SCALE // patch) ** 2
    slot_bytes = [t.numel() * t.element_size() for t in on_device]
    from_disk = args.host == "disk"
    load_slot = None
    if from_disk:
        disk_dir = args.disk_dir or Path(tempfile.mkdtemp(prefix="stepserve-record-"))
        disk_dir.mkdir(parents=True, exist_ok=True)
        record = spill(on_device, disk_dir)
        host = lambda s: record.read(str(s))  # noqa: E731
        load_slot = lambda s: record.read(str(s), cold=True)  # noqa: E731
        where = f"spilled to {record.path}, read slot by slot"
    elif device.type == "cuda":
        host = list(pin(dict(enumerate(on_device))).values())
        where = "pinned"
    else:  # the cache already is where the computation reads it: the "host" copy is itself
        host = on_device
        where = "not copied (CPU)"
    copied_bytes = slot_bytes if device.type == "cuda" or from_disk else [0] * slots
    log(f"recorded {kind.value}: {slots} slots, {tuple(on_device[0].shape)} first ({sum(slot_bytes) / 2**20:.0f} MiB), "
        f"{where}")

    cases: dict[Any, Callable[[], torch.Tensor]] = {EXACT: lambda: plain_forward(transformer, inputs)}
    per_ratio: dict[float, tuple[torch.Tensor, BlockCosts, dict[Loading, Pipeline]]] = {}
    for ratio in args.ratios:
        index = token_index(box_mask(config.image_size // VAE_SCALE, patch, ratio).to(device), patch)
        costs = measure_block_costs(transformer, inputs, index, on_device if from_disk else host, device,
                                    repeats=args.cost_repeats, kind=kind, load_slot=load_slot)
        pipelines = {loading: plan(loading, slots, *costs) for loading in LOADINGS[kind]}
        per_ratio[ratio] = (index, costs, pipelines)
        for loading, pipeline in pipelines.items():
            cases[(ratio, loading)] = forward_case(transformer, inputs, index, loading, pipeline.use_cache, host,
                                                   on_device, device, kind, from_disk)
        log(f"m={ratio}: costs measured (sum C_w {sum(costs.c_with) * 1e3:.2f} ms, C_wo "
            f"{sum(costs.c_without) * 1e3:.2f} ms, L {sum(costs.load) * 1e3:.2f} ms); slots loaded: " + ", ".join(
                f"{loading.value} {sum(p.use_cache)}/{slots}" for loading, p in pipelines.items()))

    if from_disk:  # every case starts as the first edit after a spill: nothing of the record in the page cache
        cases = {key: _cold(record, fn) for key, fn in cases.items()}
    log(f"timing {len(cases)} cases round-robin: {args.warmup} warmup + {args.repeats} rounds")
    times = timed_rounds(cases, Stopwatch(args.device), args.warmup, args.repeats)
    exact_s = statistics.median(times[EXACT])
    rows = []
    for ratio, (index, costs, pipelines) in per_ratio.items():
        outside_s = exact_s - sum(costs.c_without)
        ideal_s = statistics.median(times[(ratio, Loading.IDEAL)])
        rows.append({
            "mask_ratio": ratio, "token_ratio": index.shape[1] / tokens, "exact_s": exact_s,
            "outside_blocks_s": outside_s, "costs": costs._asdict(),
            "cases": {loading.value: case_row(loading, pipeline, pipelines[Loading.IDEAL].latency, outside_s,
                                              times[(ratio, loading)], ideal_s, copied_bytes,
                                              difference(cases[(ratio, loading)](), exact))
                      for loading, pipeline in pipelines.items()},
        })
    return {
        "benchmark": "cache_loading",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_description(args.device),
        "config": args.config, "dtype": str(dtype).removeprefix("torch."), "host": args.host,
        "transformer": config.transformer, "image_size": config.image_size, "text_tokens": config.text_tokens,
        "image_tokens": tokens, "rows": on_device[0].shape[0], "cache": kind.value,
        "blocks": len(transformer.transformer_blocks), "slots": slots, "slot_cache_mb": [b / 2**20 for b in slot_bytes],
        "threads": threads, "warmup": args.warmup, "repeats": args.repeats,
        "cost_repeats": args.cost_repeats, "exact_s": exact_s, "exact_samples_s": times[EXACT],
        "results": rows,
    }


def _cold(record: RecordFile, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        record.drop_cached_pages()
        return forward()
    return run


def plot(result: dict[str, Any], path: Path) -> None:
    """Measured forward time per plan and ratio (the DP's prediction marked), the per-slot
    costs it planned with, and which slots each DP plan loads (keys and values: every one)."""
    figure = Figure(figsize=(16, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    times, costs, loads = figure.subplots(1, 3, width_ratios=(1.3, 1, 1))
    figure.suptitle(f"cache loading from {result['host']}, masked SD3 forward with cached {result['cache']}: "
                    f"{result['config']}, "
                    f"{result['dtype']}, {result['device']}", fontsize=9)
    rows = result["results"]
    loadings = [Loading(name) for name in rows[0]["cases"]]
    width = 0.8 / len(loadings)
    for k, loading in enumerate(loadings):
        x = [i + (k - (len(loadings) - 1) / 2) * width for i in range(len(rows))]
        cases = [r["cases"][loading.value] for r in rows]
        bars = times.bar(x, [c["measured_s"] * 1e3 for c in cases], width, label=loading.value, color=f"C{k}")
        times.bar_label(bars, labels=[f"{c['overhead_vs_ideal']:+.0%}" for c in cases], fontsize=6)
        times.plot(x, [c["predicted_s"] * 1e3 for c in cases], "k_", markersize=9,
                   label="DP prediction" if k == 0 else None)
    times.axhline(result["exact_s"] * 1e3, color="grey", ls="--", label="exact forward")
    times.set_xticks(range(len(rows)), [f"m={r['token_ratio']:.2f}" for r in rows])
    times.set(ylabel="ms per forward", title=f"one forward, {result['rows']} rows (labels: vs ideal)")
    times.legend(fontsize=7)

    for i, r in enumerate(rows):
        costs.plot([c * 1e3 for c in r["costs"]["c_with"]], "o-", ms=3, color=f"C{i}",
                   label=f"C_w m={r['token_ratio']:.2f}")
    costs.plot([c * 1e3 for c in rows[0]["costs"]["c_without"]], "s-", ms=3, color="grey", label="C_wo")
    costs.plot([c * 1e3 for c in rows[0]["costs"]["load"]], "k--", label="L (load)")
    costs.set(xlabel="cache slot (block; keys_values: then the output layer)", ylabel="ms",
              title="measured per-slot costs")
    costs.xaxis.set_major_locator(MaxNLocator(integer=True))
    costs.legend(fontsize=7)

    shown = [loading for loading in (Loading.ALGORITHM1, Loading.OPTIMAL) if loading in loadings]
    shown = shown or [Loading.ALWAYS_LOAD]
    planned = [(r, loading) for r in rows for loading in shown]
    loads.pcolormesh([[float(u) for u in r["cases"][loading.value]["use_cache"]] for r, loading in planned],
                     cmap="Greens", vmin=0, vmax=1.3, edgecolors="white", linewidth=0.5)
    loads.set_yticks([i + 0.5 for i in range(len(planned))],
                     [f"m={r['token_ratio']:.2f} {loading.value}" for r, loading in planned], fontsize=7)
    loads.set_xticks([b + 0.5 for b in range(result["slots"])], range(result["slots"]), fontsize=6)
    loads.invert_yaxis()
    loads.set(xlabel="cache slot", title="slots that load their cache (green)")
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_loading.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "cache_loading.png")
    log(f"exact forward {result['exact_s'] * 1e3:.2f} ms; per case: measured (vs ideal) / DP predicted (vs ideal)")
    for row in result["results"]:
        log(f"m={row['token_ratio']:.3f}: " + " | ".join(
            f"{name} {c['measured_s'] * 1e3:.2f} ms ({c['overhead_vs_ideal']:+.0%}) / {c['predicted_s'] * 1e3:.2f} ms "
            f"({c['predicted_overhead_vs_ideal']:+.0%}), loads {len(c['loads'])}"
            for name, c in row["cases"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
