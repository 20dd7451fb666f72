"""Does the CPU memory tracker count everything that grows? A train plan run at few and at many
micro-batches per step: each stage's growth in the tracker's peak of live tensor storages
(:mod:`onnx_partition.runtime.memtrack`) against its growth in the ranks' peak resident set
(VmHWM, a fresh set of processes per run), and their ratio. Under GPipe a stage holds every
micro-batch's activations at once, so both grow by ``M`` micro-batches' worth: a tracker that
missed storages (an under-count) shows a ratio under 1. Issue 33's bar: within 10%.

    .venv/bin/python tools/bench_memory_growth.py PLAN [--microbatches 4 32]
        [--schedules gpipe 1f1b] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.trainer import train_plan

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--microbatches", type=int, nargs=2, default=[4, 32])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    plan = read_plan(args.plan)
    low, high = args.microbatches
    print(f"{args.plan}: {len(plan.stages)} stages, {plan.rows_per_microbatch} rows per "
          f"micro-batch, {args.steps} steps, M={low}->{high}; {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n| schedule | stage | tracker peak MB (M low / high) | VmHWM MB (low / high) | "
          "tracker growth MB | VmHWM growth MB | tracker / VmHWM growth |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for schedule in args.schedules:
        runs = {}
        for count in (low, high):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a schedule other than the plan's
                runs[count] = train_plan(args.plan, steps=args.steps, microbatches=count,
                                         schedule=schedule)
        for k in range(len(plan.stages)):
            peak = [runs[c].memory_bytes[k] or 0 for c in (low, high)]
            resident = [runs[c].resident_bytes[k] or 0 for c in (low, high)]
            tracked, held = peak[1] - peak[0], resident[1] - resident[0]
            ratio = f"**{tracked / held:.3f}**" if held > 0 else "-"
            print(f"| {schedule} | {k} | {peak[0] / MB:.1f} / {peak[1] / MB:.1f} | "
                  f"{resident[0] / MB:.1f} / {resident[1] / MB:.1f} | {tracked / MB:+.1f} | "
                  f"{held / MB:+.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
