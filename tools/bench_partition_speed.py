"""Planning time of ``partition`` before and after a change, and the plans, side by side.

    python tools/bench_partition_speed.py [--base main] [--work DIR] [--only bert gpt2]
        [--cases pipeline hybrid] [--stages 2 4 8] [--repeats 3]

The code "before" is ``--base`` (a git revision, default ``main``) unpacked with ``git
archive`` into a temporary folder; "after" is this checkout. Both run as fresh processes of
this interpreter (``python -m onnx_partition.cli partition``, ``PYTHONPATH`` naming which
code), alternately, on the same inputs: Hugging Face BERT (6 layers) and GPT-2 (12 layers)
built from their transformers configs with random weights (``tools/bench_pipedream.py``'s
export, cached in ``--work``), batch 8, one analytic H100 profile per model (``costs.json``),
at 100 GB/s and no latency; ``pipeline`` cuts ``--stages S`` stages, ``hybrid`` plans on
``--devices S``, both in inference.

Prints one Markdown row per model, case and size: the median ``partition_s`` (plan.json: the
planner's own time, stage files not included) of each, their ratio, each plan's period per
micro-batch (``predicted.bottleneck_ms``) and iteration, and whether the two plans are the
same (every stage's nodes and replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_pipedream import BATCH, MODELS, export, write_inputs

ROOT = Path(__file__).resolve().parents[1]
CASES = ("pipeline", "hybrid")


def unpack(base: str, into: Path) -> Path:
    """The package as of git revision ``base``, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", base, "onnx_partition"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"error: git archive {base}: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_plan(code: Path, model: Path, costs: Path, case: str, size: int, out: Path
             ) -> dict[str, Any]:
    """One ``partition`` process with the package under ``code``; its plan.json."""
    shape = ["--stages" if case == "pipeline" else "--devices", str(size)]
    argv = [sys.executable, "-m", "onnx_partition.cli", "partition", str(model), *shape,
            "--batch-size", str(BATCH), "--gpu", "h100", "--costs", str(costs), "--bandwidth",
            "100", "--latency", "0", "-o", str(out), "--force"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(code)})
    if done.returncode:
        raise SystemExit(f"partition failed ({done.returncode}): {done.stderr[-500:]}")
    plan: dict[str, Any] = json.loads((out / "plan.json").read_text())
    return plan


def shape_of(plan: dict[str, Any]) -> list[tuple[list[str], int]]:
    """Every stage's nodes and replicas: equal exactly when the plans are the same."""
    return [(sorted(map(str, s["nodes"])), int(s.get("replicas", 1))) for s in plan["stages"]]


def row(name: str, case: str, ops: int, size: int, before: list[dict[str, Any]],
        after: list[dict[str, Any]]) -> str:
    """One Markdown row of the medians and both plans' figures."""
    old_s = statistics.median(p["partition_s"] for p in before)
    new_s = statistics.median(p["partition_s"] for p in after)
    old, new = before[0]["predicted"], after[0]["predicted"]
    same = all(shape_of(p) == shape_of(before[0]) for p in before + after)
    return (f"| {name} | {case} | {ops} | {size} | {old_s:.2f} | {new_s:.2f} | "
            f"{old_s / new_s:.2f}x | {old['bottleneck_ms']:.6g} | {new['bottleneck_ms']:.6g} | "
            f"{old['iteration_ms']:.6g} | {new['iteration_ms']:.6g} | "
            f"{'yes' if same else 'NO'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="main", help="git revision of the code before")
    parser.add_argument("--work", type=Path, help="folder for models and plans (default: temp)")
    parser.add_argument("--only", nargs="*", choices=list(MODELS), help="models to run")
    parser.add_argument("--cases", nargs="*", choices=CASES, help="cases to run")
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 4, 8],
                        help="stages (pipeline) or devices (hybrid)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; medians shown")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length")
    args = parser.parse_args()
    if args.repeats < 1 or args.seq_len < 1 or not all(s >= 1 for s in args.stages):
        parser.error("--repeats, --seq-len and --stages must be >= 1")
    print("| model | case | operators | stages | before partition_s | after partition_s | "
          "before / after | before period ms | after period ms | before iteration ms | "
          "after iteration ms | same plan |")
    print("| --- " * 12 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = unpack(args.base, Path(tmp) / "base")
        for name in args.only or list(MODELS):
            model = export(name, work, args.seq_len)
            costs, _, ops = write_inputs(model, work)
            for case in args.cases or CASES:
                for size in args.stages:
                    runs: dict[Path, list[dict[str, Any]]] = {base: [], ROOT: []}
                    for _ in range(args.repeats):  # alternately, so load falls on both
                        for code, plans in runs.items():
                            out = work / f"{name}-{case}-{size}-{len(plans)}-{code.name}"
                            plans.append(run_plan(code, model, costs, case, size, out))
                    print(row(name, case, ops, size, runs[base], runs[ROOT]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
