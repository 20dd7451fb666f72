"""Measured pipeline throughput on this machine: balanced vs uniform split vs the whole model.

    python tools/bench_runtime.py [--recipe bert] [--size small] [--stages 2] [--batch-size 8]

Profiles the model on the CPU (costs.json), partitions it twice (our DP on the measured costs, and
the uniform split), then measures in one run: the whole model in one onnxruntime session with
one thread, and with as many threads as the plan uses cores (one per stage: what a user with those
cores would run instead of a pipeline); each plan as a threaded pipeline (one worker thread per
stage, one onnxruntime thread each); the balanced plan over torch.distributed (gloo, one process
per stage); and the simulator's prediction for the balanced plan. Prints a Markdown table of
samples/s and ratios against both whole-model runs (the second is the fair one: same cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import onnxruntime as ort
from _timing import samples_per_s

from onnx_partition import models
from onnx_partition.cost.profile import profile_to_file
from onnx_partition.graph.ort import session_options
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.distributed import run_distributed
from onnx_partition.runtime.infer.check import compare, random_feeds


def concurrent_speedup(model: Path, feeds: dict, copies: int, iterations: int) -> float:
    """How much faster ``copies`` independent single-threaded sessions run side by side than
    one after another: this machine's ceiling for any pipeline of that many stages."""
    sessions = [ort.InferenceSession(str(model), session_options(1),
                                     providers=["CPUExecutionProvider"]) for _ in range(copies)]
    for s in sessions:
        s.run(None, feeds)
    began = time.perf_counter()
    for _ in range(iterations):
        sessions[0].run(None, feeds)
    alone = (time.perf_counter() - began) / iterations

    def loop(session: ort.InferenceSession) -> None:
        for _ in range(iterations):
            session.run(None, feeds)

    threads = [threading.Thread(target=loop, args=(s,)) for s in sessions]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = (time.perf_counter() - began) / iterations
    return copies * alone / together


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="bert")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--no-distributed", action="store_true")
    args = parser.parse_args()
    rows, m = args.batch_size, args.microbatches
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = models.export(args.recipe, work / "model.onnx", size=args.size)
        micro = max(1, rows // m)
        costs = work / "costs.json"
        profile_to_file(model, costs, batch_size=micro, cache_dir=work / "cache")
        balanced, uniform = work / "balanced", work / "uniform"
        plan = partition(model, args.stages, balanced, costs=costs, batch_size=micro)
        partition(model, args.stages, uniform, costs=costs, batch_size=micro, solver="uniform")
        feeds = random_feeds(plan, batch_size=rows)

        whole = ort.InferenceSession(str(model), session_options(1),
                                     providers=["CPUExecutionProvider"])
        names = [o.name for o in whole.get_outputs()]
        expected = dict(zip(names, whole.run(names, feeds)))
        base = samples_per_s(partial(whole.run, names, feeds), rows, args.iterations)
        results = [("whole model, 1 session, 1 thread", base, 0.0)]
        # what a user runs instead: the whole model on every core the plan uses
        wide = ort.InferenceSession(str(model), session_options(args.stages),
                                    providers=["CPUExecutionProvider"])
        same = samples_per_s(partial(wide.run, names, feeds), rows, args.iterations)
        results.append((f"whole model, 1 session, {args.stages} threads (the plan's cores)",
                        same, compare(dict(zip(names, wide.run(names, feeds))), expected)))
        ceiling = concurrent_speedup(model, feeds, args.stages, args.iterations)
        for label, folder in (("balanced (dp on measured costs)", balanced),
                              ("uniform split", uniform)):
            with PipelineSession(folder, microbatches=m) as session:
                err = compare(dict(zip(
                    [o.name for o in session.get_outputs()], session.run(None, feeds))),
                              expected)
                rate = samples_per_s(partial(session.run, None, feeds), rows, args.iterations)
            results.append((f"{label}: {args.stages} threads", rate, err))
        sim, _ = simulate_plan(plan, schedule="infer", microbatches=m)
        predicted = rows / (sim.iteration_ms / 1000.0)
        if not args.no_distributed:
            outputs, stats = run_distributed(balanced, feeds, nproc=args.stages, microbatches=m,
                                             iterations=args.iterations + 2)
            steady = statistics.median(stats.iteration_ms[2:])
            results.append((f"balanced: {args.stages} processes (gloo)", rows / steady * 1000.0,
                            compare(dict(zip(expected, outputs)), expected)))
    print(f"{args.recipe} ({args.size}), batch {rows} in {m} micro-batches, {args.stages} stages, "
          f"{os.cpu_count()} CPUs, onnxruntime {ort.__version__}, python {sys.version.split()[0]}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) at the end: {load:.1f}")
    print(f"\n| run | samples/s | vs whole model, 1 thread | vs whole model, {args.stages} "
          "threads (same cores) | max rel err |")
    print("| --- | --- | --- | --- | --- |")
    same = results[1][1]
    for label, rate, err in results:
        print(f"| {label} | {rate:.1f} | {rate / base:.2f}x | {rate / same:.2f}x | {err:.1e} |")
    results = [results[0], *results[2:]]  # the pipelines after the 1-thread baseline
    measured = results[1][1]
    print(f"\nsimulator's prediction for the balanced plan: {predicted:.1f} samples/s; measured "
          f"{measured:.1f} ({(measured / predicted - 1) * 100:+.1f}%)")
    print(f"balanced / uniform: {results[1][1] / results[2][1]:.2f}x")
    print(f"this machine's ceiling: {args.stages} independent single-threaded sessions run "
          f"side by side {ceiling:.2f}x faster than one after another; the balanced pipeline "
          f"reaches {results[1][1] / base / ceiling * 100:.0f}% of that, and the simulator "
          f"scaled by it predicts {predicted * ceiling / args.stages:.1f} samples/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
