"""Memory a training run holds against its plan: per schedule and micro-batch count, each
stage's planned ``memory_bytes`` against the run's measured peak of live tensor storages (the
rank's tracker, :mod:`onnx_partition.runtime.memtrack`; the maximum over the stage's replicas)
and the ranks' peak resident set (VmHWM), and the measured peak's growth from the fewest to the
most micro-batches, in micro-batches' activations (the plan's ``activation_bytes``): under 1F1B
and ZB-H1 a stage holds at most ``p`` micro-batches, so it should stay well under one.

    .venv/bin/python tools/bench_memory.py PLAN [--microbatches 4 8 32] [--steps 2]
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.trainer import train_plan

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 32])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    plan = read_plan(args.plan)
    acts = [(s.predicted.activation_bytes or 0) if s.predicted else 0 for s in plan.stages]
    print(f"{args.plan}: {len(plan.stages)} stages, {plan.rows_per_microbatch} rows per "
          f"micro-batch, {args.steps} steps; MB = 1e6 bytes")
    for schedule in args.schedules:
        print(f"\n{schedule}")
        print(f"  {'M':>3} {'stage':>5} {'planned MB':>11} {'measured MB':>12} {'ratio':>6} "
              f"{'VmHWM MB':>9}")
        peaks: dict[int, list[int]] = {}
        for count in args.microbatches:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a schedule other than the plan's
                stats = train_plan(args.plan, steps=args.steps, microbatches=count,
                                   schedule=schedule)
            peaks[count] = [m or 0 for m in stats.memory_bytes]
            for k, pred in enumerate(stats.predicted_stages):
                planned = pred.memory_bytes or 0
                got = peaks[count][k]
                print(f"  {count:>3} {k:>5} {planned / MB:>11.2f} {got / MB:>12.2f} "
                      f"{got / planned if planned else 0:>6.2f} "
                      f"{(stats.resident_bytes[k] or 0) / MB:>9.1f}")
        low, high = min(peaks), max(peaks)
        for k, act in enumerate(acts):
            grown = peaks[high][k] - peaks[low][k]
            share = f" ({grown / act:+.2f} micro-batches' activations)" if act else ""
            print(f"  stage {k} growth M={low}->{high}: {grown / MB:+.2f} MB{share}")


if __name__ == "__main__":
    main()
