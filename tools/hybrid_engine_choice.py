"""Hybrid train plans of this checkout against another code tree's, on measured costs files:
the iteration each prints (simulated from plan.json with the engine's terms,
``partition.priced_as_run``), the figure its planner chose it by (the best family's simulated
iteration in plan.json's ``orderings``), its stages x replicas and schedule.

    python tools/hybrid_engine_choice.py --base-tree /work/main --dir /tmp/q2 \
        --models gpt-small resnet-small --configs "--devices 4" "--devices 4 --machines 2"

Each model is ``DIR/MODEL.onnx`` with its costs file ``DIR/MODEL-train-costs-b2.json``
(``profile --mode train``); each tree runs from a neutral directory with its own code first
on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _plan(tree: Path, model: Path, costs: Path, options: str, out: Path) -> dict:
    argv = [sys.executable, "-m", "onnx_partition.cli", "partition", str(model), "--mode",
            "train", "--costs", str(costs), *shlex.split(options), "-o", str(out), "--force"]
    subprocess.run(argv, check=True, capture_output=True, cwd=out.parent,
                   env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    return json.loads((out / "plan.json").read_text())


def _row(body: dict) -> tuple[float, float, str]:
    chosen = min(v["iteration_ms"] for v in body["orderings"].values() if "iteration_ms" in v)
    shape = "x".join(str(s["replicas"]) for s in body["stages"])
    return body["predicted"]["iteration_ms"], chosen, f"{shape} {body['schedule']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-tree", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--configs", nargs="+", default=["--devices 4"])
    args = parser.parse_args()
    print("| model | config | base: printed / chosen by, ms | base plan | this: printed / "
          "chosen by, ms | this plan | cut |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            onnx, costs = args.dir / f"{model}.onnx", args.dir / f"{model}-train-costs-b2.json"
            for n, options in enumerate(args.configs):
                plans = [_plan(tree, onnx, costs, options, Path(tmp) / f"{model}-{n}-{k}")
                         for k, tree in enumerate((args.base_tree, ROOT))]
                (bp, bc, bs), (tp, tc, ts) = (_row(p) for p in plans)
                cut = ("same" if [s["nodes"] for s in plans[0]["stages"]]
                       == [s["nodes"] for s in plans[1]["stages"]] else "changed")
                print(f"| {model} | {options} | {bp:.2f} / {bc:.2f} | {bs} | {tp:.2f} / "
                      f"{tc:.2f} | {ts} | {cut} |")


if __name__ == "__main__":
    main()
