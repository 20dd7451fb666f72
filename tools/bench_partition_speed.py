"""Planning time of ``partition`` before and after a change, and the plans, side by side.

    python tools/bench_partition_speed.py [--base main] [--work DIR] [--only bert gpt2]
        [--cases pipeline hybrid] [--stages 2 4 8] [--repeats 3]
    python tools/bench_partition_speed.py --proof [--repeats 5]

The code "before" is ``--base`` (a git revision, default ``main``) unpacked with ``git
archive`` into a temporary folder; "after" is this checkout. Both run as fresh processes of
this interpreter (``python -m onnx_partition.cli partition``, run from the code's folder with
``PYTHONPATH`` naming it; checked to import it), alternately, on the same inputs: Hugging
Face BERT (6 layers) and GPT-2 (12 layers) built from their transformers configs with random
weights (``tools/bench_pipedream.py``'s export, cached in ``--work``), batch 8, one analytic
H100 profile per model (``costs.json``), at 100 GB/s and no latency; ``pipeline`` cuts
``--stages S`` stages, ``hybrid`` plans on ``--devices S``, both in inference.

Prints one Markdown row per model, case and size: the median ``partition_s`` (plan.json:
loading, pricing and planning, stage files not included) of each and their ratio; the same of
the search (a pipeline's orderings cut and polished, the sum of ``candidates[*].seconds``; a
cluster's ``planning_s``) and the exact pass's CP-SAT seconds where it ran; each plan's period
per micro-batch (``predicted.bottleneck_ms``) and iteration; and whether the two plans are the
same (every stage's nodes and replicas, in every run). ``--proof`` prints instead the hybrid
proof's share of planning (:func:`proof_table`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_pipedream import BATCH, MODELS, export, write_inputs

from onnx_partition.progress import SILENT

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


def check_imports(code: Path) -> None:
    """Stop unless a process run as :func:`run_plan` runs it imports the package under
    ``code`` (``python -m`` puts its folder first on the path: it runs from there)."""
    found = subprocess.run([sys.executable, "-c", "import onnx_partition; "
                            "print(onnx_partition.__file__)"], capture_output=True, text=True,
                           check=True, cwd=code, env={**os.environ, "PYTHONPATH": str(code)})
    if not Path(found.stdout.strip()).resolve().is_relative_to(code.resolve()):
        raise SystemExit(f"error: the package imported is {found.stdout.strip()}, not {code}'s")


def run_plan(code: Path, model: Path, costs: Path, case: str, size: int, out: Path
             ) -> dict[str, Any]:
    """One ``partition`` process with the package under ``code``; its plan.json."""
    shape = ["--stages" if case == "pipeline" else "--devices", str(size)]
    argv = [sys.executable, "-m", "onnx_partition.cli", "partition", str(model), *shape,
            "--batch-size", str(BATCH), "--gpu", "h100", "--costs", str(costs), "--bandwidth",
            "100", "--latency", "0", "-o", str(out), "--force"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=code,
                          env={**os.environ, "PYTHONPATH": str(code)})
    if done.returncode:
        raise SystemExit(f"partition failed ({done.returncode}): {done.stderr[-500:]}")
    plan: dict[str, Any] = json.loads((out / "plan.json").read_text())
    return plan


def shape_of(plan: dict[str, Any]) -> list[tuple[list[str], int]]:
    """Every stage's nodes and replicas: equal exactly when the plans are the same."""
    return [(sorted(map(str, s["nodes"])), int(s.get("replicas", 1))) for s in plan["stages"]]


def search_s(plan: dict[str, Any]) -> float:
    """The planner's search: a pipeline's orderings (each cut and polished), a cluster's
    ``planning_s``."""
    if "candidates" in plan:
        return float(sum(c["seconds"] for c in plan["candidates"].values()))
    return float(plan.get("planning_s", 0.0))


def exact_s(plans: list[dict[str, Any]]) -> str:
    """The median seconds of the exact pass (CP-SAT), where it ran."""
    seconds = [p["exact"]["seconds"] for p in plans if "seconds" in p.get("exact", {})]
    return f"{statistics.median(seconds):.2f}" if seconds else "-"


def row(name: str, case: str, ops: int, size: int, before: list[dict[str, Any]],
        after: list[dict[str, Any]]) -> str:
    """One Markdown row of the medians and both plans' figures."""
    old_s = statistics.median(p["partition_s"] for p in before)
    new_s = statistics.median(p["partition_s"] for p in after)
    old_search = statistics.median(map(search_s, before))
    new_search = statistics.median(map(search_s, after))
    old, new = before[0]["predicted"], after[0]["predicted"]
    same = all(shape_of(p) == shape_of(before[0]) for p in before + after)
    return (f"| {name} | {case} | {ops} | {size} | {old_s:.2f} | {new_s:.2f} | "
            f"{old_s / new_s:.2f}x | {old_search:.2f} | {new_search:.2f} | "
            f"{old_search / new_search:.1f}x | {exact_s(before)} / {exact_s(after)} | "
            f"{old['bottleneck_ms']:.6g} | {new['bottleneck_ms']:.6g} | "
            f"{old['iteration_ms']:.6g} | {new['iteration_ms']:.6g} | "
            f"{'yes' if same else 'NO'} |")


def best_of(repeats: int, work: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """The least wall seconds of ``repeats`` calls of ``work(*args, **kwargs)``, and its
    answer."""
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = work(*args, **kwargs)
        times.append(time.perf_counter() - began)
    return min(times), result


def proof_table(repeats: int) -> None:
    """The hybrid proof's share of planning on the recipes' tiny models (in inference, PCIe
    setting of ``tools/bench_planner.py``, 2, 4, 8 devices), in this process: planning
    (:func:`~onnx_partition.solve.planner.proposals_for` and
    :func:`~onnx_partition.solve.plan.plan_per_schedule` from them), the proof solving the
    sequence again (``prove_hybrid`` without the planner's proposals: what it did before) and
    reusing the planner's run (with them); best of ``repeats`` each."""
    from bench_planner import SETTINGS, recipe_problem

    print("| recipe | units | D | proof | planning ms | proof solving again ms | share | "
          "proof reusing ms | share |")
    print("| --- " * 9 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("gpt", "resnet", "inception", "unet"):
            problem, arrays = recipe_problem(name, "tiny", Path(tmp), SETTINGS["pcie"])
            for devices in (2, 4, 8):
                print(proof_row(name, problem, arrays, devices, repeats), flush=True)


def proof_row(name: str, problem: Any, arrays: Any, devices: int, repeats: int) -> str:
    """One row of :func:`proof_table`."""
    from bench_planner import MICROBATCHES, SETTINGS, cluster_for

    from onnx_partition.solve.hybrid_proof import prove_hybrid
    from onnx_partition.solve.plan import plan_per_schedule
    from onnx_partition.solve.planner import HYBRID_ORDERINGS, proposals_for
    from onnx_partition.solve.scoring import RunSpec

    cluster = cluster_for(devices, SETTINGS["pcie"])
    run = RunSpec(cluster, train=False, microbatches=MICROBATCHES, max_stages=16)
    made_s, found = best_of(repeats, proposals_for, problem, arrays, run, None,
                            HYBRID_ORDERINGS)
    chose_s, (best, _, ran) = best_of(
        repeats, plan_per_schedule, problem, arrays, cluster, num_stages=None,
        microbatches=MICROBATCHES, schedules=("infer",), recompute="none", train=False,
        reporter=SILENT, proposals={"infer": found})
    plan_s = made_s + chose_s
    again_s, again = best_of(repeats, prove_hybrid, problem, arrays, ran, best)
    reuse_s, reused = best_of(repeats, prove_hybrid, problem, arrays, ran, best,
                              proposals=found)
    assert (again.by, again.period_ms) == (reused.by, reused.period_ms)
    return (f"| {name} | {problem.num_nodes} | {devices} | {reused.by} | {plan_s * 1e3:.1f} | "
            f"{again_s * 1e3:.2f} | {again_s / plan_s:.0%} | {reuse_s * 1e3:.2f} | "
            f"{reuse_s / plan_s:.0%} |")


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
    parser.add_argument("--proof", action="store_true",
                        help="instead: the hybrid proof's share of planning, tiny recipes")
    args = parser.parse_args()
    if args.proof:
        proof_table(args.repeats)
        return 0
    if args.repeats < 1 or args.seq_len < 1 or not all(s >= 1 for s in args.stages):
        parser.error("--repeats, --seq-len and --stages must be >= 1")
    print("| model | case | operators | stages | before partition_s | after partition_s | "
          "before / after | before search s | after search s | before / after | "
          "exact s before / after | before period ms | after period ms | "
          "before iteration ms | after iteration ms | same plan |")
    print("| --- " * 16 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = unpack(args.base, Path(tmp) / "base")
        for code in (base, ROOT):
            check_imports(code)
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
