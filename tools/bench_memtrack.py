"""What the CPU memory tracker (:mod:`onnx_partition.runtime.memtrack`) costs a training step:
the whole program of a train plan, forward, loss and backward at the plan's rows, timed with
and without the tracker around it (the rank's thread CPU time, medians of interleaved repeats,
so other processes on a busy machine stretch neither), and the tracker's peak beside the bytes
the step must hold at least (parameters, their gradients).

    .venv/bin/python tools/bench_memtrack.py PLAN [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from onnx_partition.plan import read_plan
from onnx_partition.runtime.memtrack import StorageTracker
from onnx_partition.runtime.train.modules import whole_module
from onnx_partition.runtime.train.task import task_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plan = read_plan(args.plan)
    task = task_for(args.plan)
    module = whole_module(args.plan).train()
    inputs, targets = task.make_batch(plan.rows_per_microbatch,
                                      torch.Generator().manual_seed(0))
    names = [s.name for s in plan.inputs]
    outputs = [s.name for s in plan.outputs]

    def step() -> None:
        outs = module(*[inputs[n] for n in names])
        task.loss_fn(dict(zip(outputs, outs, strict=True)), targets).backward()

    tracker = StorageTracker()
    tracker.adopt(module.parameters())
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats + 2):
        for tracked in (False, True):
            began = time.thread_time()
            if tracked:
                with tracker:
                    step()
            else:
                step()
            times[tracked].append(time.thread_time() - began)
    plain, tracked = (statistics.median(times[k][2:]) * 1000.0 for k in (False, True))
    weights = sum(p.untyped_storage().nbytes() for p in module.parameters())
    print(f"{args.plan}: {plan.rows_per_microbatch} rows, {args.threads} thread(s), "
          f"{args.repeats} repeats")
    print(f"  step CPU ms: untracked {plain:.2f}, tracked {tracked:.2f} "
          f"({(tracked / plain - 1) * 100:+.1f}%)")
    print(f"  tracker peak {tracker.peak / 1e6:.2f} MB; parameters {weights / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
