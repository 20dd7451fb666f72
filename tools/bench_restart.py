"""What a restart after a lost rank costs, on this machine (CPU, gloo); what a checkpoint's
writing and reading cost is ``tools/bench_checkpoint.py``'s.

    python tools/bench_restart.py [--model gpt] [--size small] [--stages 2] [--steps 6]
        [--microbatches 4] [--batch-size 2] [--workdir DIR]

Exports the recipe, partitions it in train mode into ``--stages`` stages and trains it with
AdamW ``--steps`` steps (after one warm-up step), a checkpoint every 2 steps and
``--max-restarts 1``, the last stage's rank killed (``kill -9``,
:class:`~onnx_partition.runtime.launch.hooks.KillOnce`) at its first forward of the last step.
Printed: the seconds from the kill to the end of the first replayed step (the ``--log`` line's
``time``), less that step's own time: the restart's cost (stopping every rank, starting them
again, loading the checkpoint); the steps replayed; the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from onnx_partition import models
from onnx_partition.partition import partition
from onnx_partition.runtime.launch.hooks import KillOnce
from onnx_partition.runtime.train.trainer import train_plan


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-restart-"))
    model = models.export(args.model, work / f"{args.model}.onnx", size=args.size)
    plan = work / "plan"
    partition(model, args.stages, plan, mode="train", batch_size=args.batch_size, force=True)
    common = {"plan_dir": plan, "microbatches": args.microbatches,
              "batch_size": args.batch_size, "optimizer": "adamw", "lr": 1e-3}
    train_plan(steps=1, **common)  # warm-up: the fork server, imports, page cache
    steps = args.steps
    # (e) the last stage's rank killed at its first forward of the last step
    marker, log = work / "killed", work / "e.jsonl"
    last_rank = args.stages - 1  # one replica per stage: rank k holds stage k
    hook = KillOnce(str(marker), rank=last_rank, at=(steps - 1) * args.microbatches + 1)
    train_plan(steps=steps, checkpoint_dir=work / "e", checkpoint_every=2, max_restarts=1,
               log=log, hook=hook, **common)
    killed_at = float(marker.read_text())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    first_after = next(line for line in lines if line["time"] > killed_at)
    step_s = 1.0 / first_after["samples_per_s"] * args.batch_size * args.microbatches
    restart_s = first_after["time"] - killed_at - step_s
    one = next(p for p in sorted((work / "e").iterdir()) if p.name.startswith("step-"))
    print(f"{args.model} {args.size}, {args.stages} stages, AdamW, {steps} steps of "
          f"{args.microbatches} x {args.batch_size} rows; work in {work}")
    print("| quantity | figure |")
    print("| --- | --- |")
    print(f"| a checkpoint (every rank's parameters, AdamW moments, RNG) | "
          f"{_size(one) / 1e6:.1f} MB |")
    print(f"| one step | {step_s:.2f} s |")
    print(f"| lost rank to first replayed step, less the step | {restart_s:.2f} s |")
    replayed = [line["step"] for line in lines if line.get("replayed")]
    print(f"| steps replayed (--checkpoint-every 2) | {replayed} |")


if __name__ == "__main__":
    main()
