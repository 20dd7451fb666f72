"""What a checkpoint, a resume and a restart after a lost rank cost, on this machine (CPU, gloo).

    python tools/bench_restart.py [--model gpt] [--size small] [--stages 2] [--steps 6]
        [--microbatches 4] [--batch-size 2] [--workdir DIR]

Exports the recipe, partitions it in train mode into ``--stages`` stages and trains it with
AdamW (after one warm-up run; the shortest of two runs where two are timed) four ways, each
``--steps`` steps: (a) without checkpoints; (b) checkpointing after every
step; (c) resumed from (b)'s checkpoint of step ``steps - 1`` for the last step, against (d)
one fresh step; and (e) as (b) with ``--max-restarts 1``, the last stage's rank killed
(``kill -9``, :class:`~onnx_partition.runtime.launch.hooks.KillOnce`) at its first forward of
the last step. Printed: a checkpoint's bytes, seconds per checkpoint ((b) - (a) over the steps)
and GB/s written; seconds a resume adds to a start ((c) - (d)) and GB/s read; seconds from the
kill to the first replayed step's end (the ``--log`` line's ``time``), less that step's own
time: the restart's cost (stopping every rank, starting them again, loading the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from onnx_partition import models
from onnx_partition.partition import partition
from onnx_partition.runtime.launch.hooks import KillOnce
from onnx_partition.runtime.train.trainer import train_plan


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _timed(repeats: int = 1, **keywords: object) -> float:
    """The shortest wall time of ``repeats`` runs of ``train_plan(**keywords)``; a checkpoint
    folder is emptied between them."""
    best = float("inf")
    for _ in range(repeats):
        folder = keywords.get("checkpoint_dir")
        if isinstance(folder, Path) and folder.exists():
            shutil.rmtree(folder)
        began = time.perf_counter()
        train_plan(**keywords)  # type: ignore[arg-type]
        best = min(best, time.perf_counter() - began)
    return best


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
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    model = models.export(args.model, work / f"{args.model}.onnx", size=args.size)
    plan = work / "plan"
    partition(model, args.stages, plan, mode="train", batch_size=args.batch_size, force=True)
    common = {"plan_dir": plan, "microbatches": args.microbatches,
              "batch_size": args.batch_size, "optimizer": "adamw", "lr": 1e-3}
    steps = args.steps
    _timed(steps=1, **common)  # warm-up: the fork server, imports, page cache
    plain = _timed(2, steps=steps, **common)
    saving = _timed(2, steps=steps, checkpoint_dir=work / "b", checkpoint_every=1, **common)
    one = next(p for p in sorted((work / "b").iterdir()) if p.name.startswith("step-"))
    nbytes = _size(one)
    per_checkpoint = max(saving - plain, 0.0) / steps
    # (c) resume the last step from (b)'s checkpoint of step steps - 1 (the later ones moved
    # aside so it is the newest), against (d) a fresh one-step run
    resume_dir = work / "c"
    resume_dir.mkdir()
    keep = sorted(p for p in (work / "b").iterdir() if p.name.startswith("step-"))[-2]
    keep.rename(resume_dir / keep.name)
    resumed = _timed(steps=steps, resume=resume_dir, **common)
    fresh = _timed(2, steps=1, **common)
    per_resume = max(resumed - fresh, 0.0)
    # (e) the last stage's rank killed at its first forward of the last step
    marker, log = work / "killed", work / "e.jsonl"
    last_rank = args.stages - 1  # one replica per stage: rank k holds stage k
    hook = KillOnce(str(marker), rank=last_rank, at=(steps - 1) * args.microbatches + 1)
    _timed(steps=steps, checkpoint_dir=work / "e", checkpoint_every=2, max_restarts=1,
           log=log, hook=hook, **common)
    killed_at = float(marker.read_text())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    first_after = next(line for line in lines if line["time"] > killed_at)
    step_s = 1.0 / first_after["samples_per_s"] * args.batch_size * args.microbatches
    restart_s = first_after["time"] - killed_at - step_s
    gb = nbytes / 1e9
    print(f"{args.model} {args.size}, {args.stages} stages, AdamW, {steps} steps of "
          f"{args.microbatches} x {args.batch_size} rows; work in {work}")
    print("| quantity | figure |")
    print("| --- | --- |")
    print(f"| a checkpoint (every rank's parameters, AdamW moments, RNG) | {nbytes / 1e6:.1f} MB |")
    print(f"| run without / with a checkpoint every step | {plain:.2f} s / {saving:.2f} s |")
    print(f"| seconds per checkpoint written | {per_checkpoint:.3f} s "
          f"({gb / per_checkpoint if per_checkpoint else float('inf'):.2f} GB/s) |")
    print(f"| seconds a resume adds to a start | {per_resume:.3f} s "
          f"({gb / per_resume if per_resume else float('inf'):.2f} GB/s) |")
    print(f"| lost rank to first replayed step, less the step | {restart_s:.2f} s |")
    replayed = [line["step"] for line in lines if line.get("replayed")]
    print(f"| steps replayed (--checkpoint-every 2) | {replayed} |")


if __name__ == "__main__":
    main()
