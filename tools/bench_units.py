"""What the train-mode, unoptimized export costs the planner: graph sizes and planning time.

    python tools/bench_units.py [--sizes tiny small] [--stages 4]

For every recipe and size: ONNX nodes of the exporter's optimized eval-mode export (the export
before issue 12) and of onnx_partition.export (train mode, optimize=False), the nodes the
solvers cut (free constants excluded), the FX units they see after contraction, and
`partition --stages S --order auto` wall time on each export. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from onnx_partition import models
from onnx_partition.cost.annotate import annotate
from onnx_partition.graph import load
from onnx_partition.graph.export import BATCH, export, quiet
from onnx_partition.graph_arrays import unit_problem
from onnx_partition.partition import Link, partition


def _optimized_eval_export(name: str, size: str, path: Path) -> Path:
    recipe = models.build(name, size)
    args = tuple(recipe.inputs.values())
    with quiet():
        torch.onnx.export(recipe.module.eval(), args, path, input_names=list(recipe.inputs),
                          output_names=recipe.output_names, dynamo=True,
                          dynamic_shapes=tuple({0: torch.export.Dim(BATCH)} for _ in args))
    return path


def _plan_seconds(model: Path, out: Path, stages: int) -> float:
    started = time.perf_counter()
    partition(model, stages, out, batch_size=8, mode="train", force=True, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=list(models.RECIPES))
    parser.add_argument("--sizes", nargs="*", default=["tiny", "small"])
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    print("| recipe | size | optimized eval nodes | train export nodes | cut nodes | FX units | "
          "partition s (optimized) | partition s (train, units) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in args.sizes:
            for name in args.recipes:
                old = _optimized_eval_export(name, size, root / f"{name}-{size}-opt.onnx")
                recipe = models.build(name, size)
                new = export(recipe.module, tuple(recipe.inputs.values()),
                             root / f"{name}-{size}.onnx", input_names=list(recipe.inputs),
                             output_names=recipe.output_names)
                graph_old, graph_new = load(old, batch_size=8), load(new, batch_size=8)
                units, nodes, _ = unit_problem(graph_new, annotate(graph_new).forward_ms, Link())
                t_old = _plan_seconds(old, root / "p-old", args.stages)
                t_new = _plan_seconds(new, root / "p-new", args.stages)
                print(f"| {name} | {size} | {len(graph_old.nodes)} | {len(graph_new.nodes)} | "
                      f"{len(nodes)} | {units.num_nodes} | {t_old:.2f} | {t_new:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
