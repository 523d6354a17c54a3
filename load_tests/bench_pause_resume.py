"""What pausing and resuming a video costs against one of its steps (GenServe Table 7).

For each video shape, a `StepRunner` runs three plans over and over: one step of the video, an
export to host memory (pause: the latents, the scheduler's multistep history, the generator and
the text embeddings are copied off the device) and an admission from that state (resume); the
medians of the plans' own durations (`StepReport.duration_s`) are reported.
The state also crosses a pickle round trip, which is what Ray does when the router hands a
paused video to another worker.

    python -m stepserve.load_tests.bench_pause_resume --out results/pause-resume            # tiny Wan, CPU
    python -m stepserve.load_tests.bench_pause_resume --preset full --device cuda \
        --sizes 480x832 --frames 81 --out results/pause-resume-gpu                        # on a GPU

Writes pause_resume.json and pause_resume.png (pause, resume and pickle as % of a step).
GenServe measures a pause at ~3 us and a resume under 0.15% of a 720p step.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from stepserve.engine.families import ALL_PARTS, ModelSource, load_family
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.load_tests.plots import plot_pause_resume
from stepserve.policies.types import RequestKind, RequestSpec, StepGroup, WorkerPlan


def run(runner: StepRunner, plan: WorkerPlan, admissions: dict | None = None) -> tuple:
    report, payloads = runner.execute(plan, admissions or {})
    if report.failed:
        raise RuntimeError(f"plan failed: {report.failed}")
    return report, payloads


def measure(runner: StepRunner, family, spec: RequestSpec, repeats: int) -> dict:
    rid = spec.request_id
    step, pause = WorkerPlan("bench", groups=(StepGroup((rid,)),)), WorkerPlan("bench", export=(rid,))
    run(runner, WorkerPlan("bench", admit=(rid,)), {rid: Admission(spec, encode_conditioning(family, spec))})
    run(runner, step)  # warm-up; the multistep history is non-empty from here on
    steps, pauses, resumes, pickles, sizes = [], [], [], [], []
    for _ in range(repeats):
        steps.append(run(runner, step)[0].duration_s)
        report, (state,) = run(runner, pause)
        pauses.append(report.duration_s)
        begin = time.perf_counter()
        blob = pickle.dumps(state)
        state = pickle.loads(blob)
        pickles.append(time.perf_counter() - begin)
        sizes.append(len(blob))
        report, _ = run(runner, WorkerPlan("bench", admit=(rid,)), {rid: Admission(spec, state=state)})
        resumes.append(report.duration_s)
    run(runner, WorkerPlan("bench", drop=(rid,)))
    step = statistics.median(steps)
    row = {"height": spec.height, "width": spec.width, "frames": spec.num_frames, "step_ms": step * 1e3,
           "pause_ms": statistics.median(pauses) * 1e3, "resume_ms": statistics.median(resumes) * 1e3,
           "pickle_ms": statistics.median(pickles) * 1e3, "state_bytes": statistics.median(sizes)}
    for key in ("pause", "resume", "pickle"):
        row[f"{key}_pct_of_step"] = 100 * row[f"{key}_ms"] / row["step_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepserve.load_tests.bench_pause_resume", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "full"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="32x32,64x64,128x128", help="HxW list")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    torch.set_num_threads(1) if args.device == "cpu" else None
    source = ModelSource(name="wan", family="wan", preset=args.preset, seed=0,
                         dtype="float32" if args.device == "cpu" else "bfloat16")
    family = load_family(source, ALL_PARTS, args.device)
    runner = StepRunner("bench", {"wan": family})
    rows = []
    for size in args.sizes.split(","):
        height, width = (int(v) for v in size.split("x"))
        spec = RequestSpec(f"v{height}x{width}", "wan", "a red fox runs through snow", width, height, args.steps,
                           5.0, 0, kind=RequestKind.T2V, num_frames=args.frames)
        row = measure(runner, family, spec, args.repeats)
        rows.append(row)
        print(f"{height}x{width}x{args.frames}: step {row['step_ms']:.2f} ms, pause {row['pause_ms']:.3f} ms "
              f"({row['pause_pct_of_step']:.2f}%), resume {row['resume_ms']:.3f} ms ({row['resume_pct_of_step']:.2f}%), "
              f"pickle {row['pickle_ms']:.3f} ms, state {row['state_bytes'] / 1e6:.2f} MB", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "device": args.device, "frames": args.frames, "steps": args.steps,
              "repeats": args.repeats, "rows": rows,
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}"}
    (out / "pause_resume.json").write_text(json.dumps(report, indent=2))
    plot_pause_resume(rows, f"Pause / resume vs one step ({args.preset} Wan, {args.device})", out / "pause_resume.png")
    print(f"wrote {out / 'pause_resume.json'} and {out / 'pause_resume.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
