"""Plans of this checkout against those of another revision, for refactors that must not move them.

Exports the recipes once, partitions each with both code trees in several configurations (the
sequence DP, the cluster ordering, the ILP, the hybrid planner for inference and for training on
two machines), all priced by the analytic H100 model so that no measurement makes them differ, and
prints one table row per plan: identical, or what differs. Timing fields are left out. The ILP
runs with a time limit and several workers, so equal-cost optima may differ; its row then
compares the proven bottleneck instead.

    python tools/compare_plans.py --base HEAD~3 [--size tiny|small] [--recipes gpt bert]

With ``--memory-fractions 0.9 0.5``: also train plans where memory binds (``--devices 4``,
batch 2, 4 micro-batches), the device memory that fraction of the largest stage of the base
tree's plan without a limit, the same bytes for both trees. A plan whose stages and replicas
are unchanged but whose memory figures moved says so apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("resnet", "inception", "unet", "gpt", "bert", "encdec")
CONFIGS = {
    "dp4": ["--stages", "4", "--batch-size", "8"],
    "cluster3": ["--stages", "3", "--order", "cluster", "--batch-size", "8"],
    "ilp5": ["--stages", "5", "--solver", "ilp", "--time-limit", "5", "--batch-size", "8"],
    "hybrid4": ["--devices", "4", "--batch-size", "8"],
    "train2x4": ["--devices", "4", "--machines", "2", "--mode", "train", "--batch-size", "4"],
}
#: Train plans where memory binds (with --memory-fractions): the unlimited plan, then limits.
BOUND = ["--devices", "4", "--mode", "train", "--batch-size", "2", "--microbatches", "4"]
#: Per-stage figures of memory, which a new count moves without moving the plan.
MEMORY = {"memory_bytes", "buffer_bytes", "static_bytes", "activation_bytes", "input_bytes",
          "weights_bytes", "grad_bytes", "optimizer_bytes", "devices_notes"}
TIMINGS = {"partition_s", "planning_s", "seconds", "wall_s", "version", "manifest", "plan_dir"}
#: Records a newer tree adds that say what a plan is, not what it is (compared apart).
RECORDS = {"planned_over"}


def partition(tree: Path, model: Path, args: list[str], out: Path) -> dict[str, Any] | str:
    """plan.json and the --json summary (timings dropped) written by ``tree``'s code, or the
    error it printed."""
    command = [sys.executable, "-m", "onnx_partition.cli", "partition", str(model), "-o",
               str(out), "--device-kind", "cuda", "--json", "-q", *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
    plan = json.loads((out / "plan.json").read_text())
    return {"plan": _strip(plan), "summary": _strip(json.loads(done.stdout))}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def verdict(name: str, ours: dict[str, Any] | str, theirs: dict[str, Any] | str) -> str:
    if isinstance(ours, str) or isinstance(theirs, str):
        return "same error" if ours == theirs else f"differs: {theirs!r} -> {ours!r}"
    over = ours["plan"].get("planned_over")
    said = f" (over {over['units']} {over['granularity']} units)" if over else ""
    if _without(ours["plan"], RECORDS) == _without(theirs["plan"], RECORDS):
        return "identical" + said
    if name.startswith("ilp"):
        a, b = theirs["summary"].get("ilp", {}), ours["summary"].get("ilp", {})
        if a.get("optimal") and b.get("optimal") and a.get("bottleneck_ms") == b.get(
                "bottleneck_ms"):
            return f"another optimum, same bottleneck {a['bottleneck_ms']:.6g} ms"
    changed = sorted(k for k in {*ours["plan"], *theirs["plan"]} - RECORDS
                     if ours["plan"].get(k) != theirs["plan"].get(k))
    if _without(ours["plan"], MEMORY | RECORDS) == _without(theirs["plan"], MEMORY | RECORDS):
        return "same stages and replicas; memory figures differ in " + ", ".join(changed) + said
    return "differs in " + ", ".join(changed) + said + _figures(ours, theirs)


def _figures(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """How the plan's figures moved: its bottleneck and simulated iteration, base -> ours."""
    a, b = theirs["plan"].get("predicted", {}), ours["plan"].get("predicted", {})
    moved = [f"{key} {a[key]:.6g} -> {b[key]:.6g}" for key in ("bottleneck_ms", "iteration_ms")
             if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float))]
    return f"; {', '.join(moved)}" if moved else ""


def _without(value: Any, keys: set[str]) -> Any:
    if isinstance(value, dict):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_without(v, keys) for v in value]
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--memory-fractions", nargs="*", type=float, default=[],
                        help="also train plans at these fractions of the unlimited plan's "
                             "largest stage")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        base = work / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base),
                        args.base], check=True)
        try:
            print(f"plans of {ROOT} against {args.base} (size {args.size})\n")
            print("| recipe | config | verdict |\n| --- | --- | --- |")
            same = total = 0
            for recipe in args.recipes:
                model = work / f"{recipe}.onnx"
                subprocess.run([sys.executable, "-m", "onnx_partition.cli", "export", recipe,
                                "--size", args.size, "-o", str(model), "-q"], check=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
                for name in args.configs:
                    ours = partition(ROOT, model, CONFIGS[name], work / f"ours-{recipe}-{name}")
                    theirs = partition(base, model, CONFIGS[name],
                                       work / f"base-{recipe}-{name}")
                    row = verdict(name, ours, theirs)
                    total += 1
                    same += not row.startswith("differs")
                    print(f"| {recipe} | {name} | {row} |", flush=True)
                if args.memory_fractions:
                    free = partition(base, model, BOUND, work / f"free-{recipe}")
                    if isinstance(free, str):
                        print(f"| {recipe} | train4 | base failed: {free} |")
                        continue
                    top = max(s["predicted"]["memory_bytes"] for s in free["plan"]["stages"])
                    for fraction in args.memory_fractions:
                        limit = ["--device-memory", f"{fraction * top / 1e9:.9f}"]
                        name = f"train4@{fraction:g}"
                        ours = partition(ROOT, model, BOUND + limit, work / f"ours-{recipe}-{name}")
                        theirs = partition(base, model, BOUND + limit,
                                           work / f"base-{recipe}-{name}")
                        row = verdict(name, ours, theirs)
                        total += 1
                        same += not row.startswith("differs")
                        print(f"| {recipe} | {name} ({fraction * top:.0f} B) | {row} |",
                              flush=True)
            print(f"\n{same} of {total} plans unchanged")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           check=False)
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
