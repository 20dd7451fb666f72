"""ZB-H1's split backward priced (``split_ms``) against a training run, and a run at another
batch size predicted with the per-step terms kept (issue 20 items 2 and 3).

    python tools/bench_split_pricing.py [--size tiny] [--stages 3] [--rows 4] [--steps 5]

Exports gpt at ``--size``, profiles it (``profile --mode train``, which measures the split's
cost per weight group, ``engine.split_call_ms``), plans it for ZB-H1 in ``--stages`` stages,
analytically and on the profile, and trains each plan (``train --json``, 4 micro-batches).
Prints per stage the run's backward in thread CPU time (its ``I`` + ``W``) against the plan's
predicted backward without and with ``split_ms``; then, per plan, the predicted step at twice
the plan's rows as ``train`` predicted it before (the whole iteration doubled) and now (the
costs at the run's rows simulated: ``PipelineCosts.at_rows``). Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from onnx_partition import models
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.pipeline.schedules import build
from onnx_partition.pipeline.simulate import simulate
from onnx_partition.plan import read_plan


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "onnx_partition.cli", *args],
                          capture_output=True, text=True, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    model = models.export("gpt", root / "gpt.onnx", size=args.size)
    costs = root / "costs.json"
    _cli("profile", str(model), "--mode", "train", "--batch-size", str(args.rows),
         "--repeats", "5", "-o", str(costs))
    call = json.loads(costs.read_text())["engine"].get("split_call_ms")
    print(f"gpt {args.size}, {args.stages} ZB-H1 stages, {args.rows} rows per micro-batch; "
          f"profile --mode train: split_call_ms {call}")
    print("| costs | stage | run's backward CPU ms | predicted without split_ms | ratio | "
          "split_ms | predicted with | **ratio** |")
    print("|---|---|---|---|---|---|---|---|")
    steps = []
    for name, given in (("analytic", None), ("profiled", costs)):
        out = root / name
        partition(model, args.stages, out, batch_size=args.rows, mode="train",
                  schedule="zb-h1", check=False, **({"costs": str(given)} if given else {}))
        plan = read_plan(out)
        split = plan.simulator_costs.split_ms or []
        body = json.loads(_cli("train", str(out), "--nproc", str(args.stages), "--steps",
                               str(args.steps), "--microbatches", "4", "--json"))
        for k in range(args.stages):
            got = body["measured"]["stages"][k]["backward_cpu_ms"]
            want = body["predicted"]["stages"][k]["backward_ms"]
            print(f"| {name} | {k} | {got:.3f} | {want - split[k]:.3f} | "
                  f"{got / (want - split[k]):.2f} | {split[k]:.3f} | {want:.3f} | "
                  f"**{got / want:.2f}** |")
        result, plan_costs = simulate_plan(plan, schedule="zb-h1", microbatches=4)
        now = simulate(build("zb-h1", [s.replicas for s in plan_costs.stages], 4),
                       plan_costs.at_rows(2.0)).iteration_ms
        steps.append((name, result.iteration_ms, max(s.step_ms for s in plan_costs.stages),
                      2 * result.iteration_ms, now))
    print()
    print("| costs | predicted step at the plan's rows | of which step_ms | at 2x rows before "
          "(x2) | at 2x rows now |")
    print("|---|---|---|---|---|")
    for name, one, step, before, now in steps:
        print(f"| {name} | {one:.3f} | {step:.3f} | {before:.3f} | {now:.3f} |")


if __name__ == "__main__":
    main()
