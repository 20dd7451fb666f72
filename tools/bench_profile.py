"""How well profiled costs predict each stage's measured time on this CPU, per recipe.

    python tools/bench_profile.py [--size small] [--recipes resnet ...] [--stages 4]
        [--batch-size 8] [--repeats 30] [--cache DIR]

For each recipe: export, ``onnx-partition profile`` (one thread, the profile cache in a
temporary folder or ``--cache``), partition into ``--stages`` stages with those costs, then time
every stage file alone in an onnxruntime session with the runtime's own options (one thread),
fed with the tensors the previous stages really make. A stage's prediction is the sum of its
nodes' profiled times (``predicted.compute_ms``); the measurement is the median thread CPU time
of ``--repeats`` rounds in which the whole model and every stage take turns. Also: the whole
model's time, and the sum of the stages' (what cutting adds). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_partition import models
from onnx_partition.cost.profile import profile_to_file
from onnx_partition.graph.ort import session_options
from onnx_partition.partition import partition
from onnx_partition.runtime.infer.check import random_feeds
from onnx_partition.runtime.infer.sessions import load_stages


def cpu_ms(runs: list[tuple[ort.InferenceSession, dict[str, np.ndarray]]],
           repeats: int) -> list[float]:
    """Median thread CPU time of one run of each session (one intra-op thread runs on the
    caller's thread), the sessions taking turns so that a slow spell of the machine hits them
    all alike."""
    times: list[list[float]] = [[] for _ in runs]
    for session, feeds in runs:
        session.run(None, feeds)
    for _ in range(repeats):
        for k, (session, feeds) in enumerate(runs):
            began = time.thread_time()
            session.run(None, feeds)
            times[k].append((time.thread_time() - began) * 1000.0)
    return [statistics.median(t) for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=models.SIZES)
    parser.add_argument("--recipes", nargs="*", default=list(models.RECIPES))
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cache", type=Path, default=None, help="keep exports and profiles")
    args = parser.parse_args()
    print(f"Size {args.size}, batch {args.batch_size}, {args.stages} stages, one thread, "
          f"onnxruntime {ort.__version__}; times in ms (median thread CPU time).\n")
    print("| recipe | stage | ops | predicted | measured | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.cache or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in args.recipes:
            model = root / f"{name}-{args.size}.onnx"
            if not model.exists():
                models.export(name, model, size=args.size)
            costs = root / f"{name}-{args.size}-b{args.batch_size}.costs.json"
            profile_to_file(model, costs, batch_size=args.batch_size, cache_dir=root / "profiles")
            out = root / f"{name}-plan"
            plan = partition(model, args.stages, out, costs=costs, batch_size=args.batch_size,
                             force=True)
            _, stages = load_stages(out, threads_per_stage=1)
            env = dict(random_feeds(plan, batch_size=args.batch_size))
            whole = ort.InferenceSession(str(model), sess_options=session_options(1),
                                         providers=["CPUExecutionProvider"])
            runs = [(whole, {i.name: env[i.name] for i in whole.get_inputs()})]
            for stage, *_ in stages:
                feeds = {n: env[n] for n in stage.inputs}
                env.update(zip(stage.outputs, stage.session.run(stage.outputs, feeds)))
                runs.append((stage.session, feeds))
            whole_ms, *measured = cpu_ms(runs, args.repeats)
            errors = []
            for k, ms in enumerate(measured):
                predicted = plan.stages[k].predicted
                guess = predicted.compute_ms if predicted else float("nan")
                errors.append(guess / ms - 1.0 if ms > 0 else float("nan"))
                print(f"| {name} | {k} | {len(plan.stages[k].nodes)} | {guess:.3f} | "
                      f"{ms:.3f} | {errors[-1] * 100:+.1f}% |", flush=True)
            total = sum(measured)
            summary.append((name, max(errors, key=abs), whole_ms, total))
    print("\n| recipe | worst stage error | whole model ms | sum of stages ms | cut overhead |")
    print("| --- | --- | --- | --- | --- |")
    for name, worst, whole_ms, total in summary:
        print(f"| {name} | {worst * 100:+.1f}% | {whole_ms:.3f} | {total:.3f} | "
              f"{(total / whole_ms - 1) * 100:+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
