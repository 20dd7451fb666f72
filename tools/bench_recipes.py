"""Partition time and pipelined-run throughput for every recipe, in one run.

    python tools/bench_recipes.py [--size small] [--stages 2 4] [--batch-size 8] [--iterations 20]

For each recipe and stage count: the time to partition (load + costs + DP + writing checked stage
files), the planner's predicted bottleneck, and the measured throughput of the pipelined run
(one thread per stage, 4 micro-batches per batch) as a ratio to the whole model in one
single-threaded onnxruntime session. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort
from _timing import samples_per_s

from onnx_partition import models
from onnx_partition.graph.ort import session_options
from onnx_partition.partition import partition
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.infer.check import compare, random_feeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--recipes", nargs="*", default=list(models.RECIPES))
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    print("| recipe | size | nodes | S | partition s | predicted bottleneck ms | "
          "whole model samples/s | pipelined samples/s | ratio | max rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.recipes:
            model = models.export(name, Path(tmp) / f"{name}.onnx", size=args.size)
            whole = ort.InferenceSession(str(model), session_options(1),
                                         providers=["CPUExecutionProvider"])
            for stages in args.stages:
                out = Path(tmp) / f"{name}-{stages}"
                began = time.perf_counter()
                plan = partition(model, stages, out, batch_size=args.batch_size)
                seconds = time.perf_counter() - began
                feeds = random_feeds(plan, batch_size=args.batch_size)
                pipe = PipelineSession(out, microbatches=args.microbatches)
                names = [o.name for o in pipe.get_outputs()]
                err = compare(dict(zip(names, pipe.run(None, feeds))),
                              dict(zip(names, whole.run(names, feeds))))
                base = samples_per_s(partial(whole.run, names, feeds), args.batch_size,
                                  args.iterations)
                piped = samples_per_s(partial(pipe.run, None, feeds), args.batch_size,
                                   args.iterations)
                nodes = sum(len(s.nodes) for s in plan.stages)
                print(f"| {name} | {args.size} | {nodes} | {stages} | {seconds:.2f} | "
                      f"{plan.predicted.bottleneck_ms:.3f} | {base:.1f} | {piped:.1f} | "
                      f"{piped / base:.2f}x | {err:.1e} |", flush=True)
    print(f"\nmachine: {sys.platform}, python {sys.version.split()[0]}, onnxruntime "
          f"{ort.__version__}, numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
