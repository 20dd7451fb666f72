"""Which measurement of ``profile --mode train`` reproduces a stage's slowdown in a CPU run:
the whole program's forward and backward (thread CPU time, medians) alone in the tight loop
against (a) the same loop beside a co-runner process, (b) the interleaved pattern alone (two
forwards, then their backwards) and (c) both, set against the run's own ratio: a 2-stage
1F1B ``train`` of the plan priced by the profile *unscaled*, its stages' thread CPU time over
their predicted time, summed over the stages (per stage after it), and (last column) the same
CPU time over the profile's own alone-tight CPU time: both CPU times, so that a load on the
machine while profiling (which stretches the prediction's wall times) does not enter it.

    python tools/bench_side_by_side.py [--models gpt bert ... hf-gpt2] [--size small]
        [--batch-size 2] [--microbatches 4] [--steps 6] [--repeats 5] [--workdir DIR]
        [--no-run]

The factor ``profile --mode train`` records is one of the three columns
(:data:`onnx_partition.cost.profile.side_by_side.PATTERN`); the table is what chose it. Times
are of this machine as it is: say its load with the figures. ``--no-run``: the profile's
columns only.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_train_predicted import exported

from onnx_partition import models
from onnx_partition.cost.profile.torch_ops import profile_train_to_file
from onnx_partition.errors import one_line
from onnx_partition.partition import partition
from onnx_partition.runtime.train.results import comparison
from onnx_partition.runtime.train.trainer import train_plan


def unscaled(costs: Path) -> Path:
    """A copy of the costs file without its ``side_by_side`` (the plan priced as before)."""
    body = json.loads(costs.read_text())
    body.get("settings", {}).pop("side_by_side", None)
    out = costs.with_name(costs.stem + "-unscaled.json")
    out.write_text(json.dumps(body))
    return out


def in_run(model: Path, costs: Path, args: argparse.Namespace, work: Path
           ) -> tuple[float, float, str, list[float]]:
    """The run's forward and backward thread CPU time over the prediction (sums over stages),
    the per-stage ratios as text and the sums themselves (CPU ms per micro-batch)."""
    plan_dir = work / f"{model.stem}-plan-unscaled"
    partition(model, 2, plan_dir, costs=unscaled(costs), batch_size=args.batch_size,
              mode="train", microbatches=args.microbatches, schedule="1f1b", check=False,
              force=True)
    stats = train_plan(plan_dir, steps=args.steps, microbatches=args.microbatches,
                       batch_size=args.batch_size)
    body = comparison(stats)
    got, want = body["measured"]["stages"], body["predicted"]["stages"]
    fwd = sum(s["forward_cpu_ms"] for s in got) / sum(s["forward_ms"] for s in want)
    bwd = sum(s["backward_cpu_ms"] for s in got) / sum(s["backward_ms"] for s in want)
    per = " / ".join(f"{s['forward_cpu_ms']:.2f}" for s in body["ratio"]["stages"]) + ", " + \
        " / ".join(f"{s['backward_cpu_ms']:.2f}" for s in body["ratio"]["stages"])
    sums = [sum(s["forward_cpu_ms"] for s in got), sum(s["backward_cpu_ms"] for s in got)]
    return fwd, bwd, per, sums


def row(name: str, args: argparse.Namespace, work: Path) -> str:
    try:
        model = exported(name, args.size, args.batch_size, work)
        costs = work / f"{model.stem}-train-costs-b{args.batch_size}.json"
        if not costs.exists():
            profile_train_to_file(model, costs, batch_size=args.batch_size,
                                  repeats=args.repeats, threads=1)
        side: dict[str, Any] = json.loads(costs.read_text())["settings"]["side_by_side"]
        if "skipped" in side:
            return f"| {name} | skipped: {side['skipped']} |"
        ms = side["cpu_ms"]
        base = ms["alone-tight"]

        def ratio(key: str) -> str:
            return f"{ms[key][0] / base[0]:.2f} / {ms[key][1] / base[1]:.2f}"

        cells = [f"{base[0]:.2f} / {base[1]:.2f}", ratio("together-tight"),
                 ratio("alone-interleaved"), ratio("together-interleaved"),
                 f"{side['forward']:.2f} / {side['backward']:.2f}"]
        if not args.no_run:
            fwd, bwd, per, sums = in_run(model, costs, args, work)
            cells += [f"{fwd:.2f} / {bwd:.2f}", per,
                      f"**{sums[0] / base[0]:.2f} / {sums[1] / base[1]:.2f}**"]
        return f"| {name} | " + " | ".join(cells) + " |"
    except Exception as exc:  # one model's failure is one row
        return f"| {name} | failed: {one_line(exc)} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*models.RECIPES, "hf-gpt2"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5, help="profile's timed repetitions")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--no-run", action="store_true", help="the profile's columns only")
    args = parser.parse_args()
    print(f"whole program, one torch thread, {args.batch_size} rows, thread CPU time, medians "
          f"of {args.repeats}; run: 2 stages, 1F1B, {args.microbatches} micro-batches, "
          f"{args.steps} steps; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the start, torch {torch.__version__}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-side-by-side-"))
    work.mkdir(parents=True, exist_ok=True)
    print("\n| model | alone tight ms fwd / bwd | co-run / alone | interleaved / alone | "
          "co-run interleaved / alone | recorded factor | in the run (CPU time / predicted) "
          "| in the run per stage (fwd, bwd) | in the run (CPU time / alone tight CPU time) |")
    print("| --- |" + " ---: |" * 8)
    for name in args.models:
        print(row(name, args, work), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
