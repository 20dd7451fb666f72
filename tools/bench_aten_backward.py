"""Backward over forward per recipe: the one-factor rule, the analytic backward per aten op, and
torch eager measured (issue 20 item 3).

    python tools/bench_aten_backward.py [--recipes resnet,inception,unet,gpt,bert,encdec]
        [--size tiny] [--batch-size 4] [--repeats 5]

For each recipe: ``export``; the graph at ``--batch-size`` rows; the forward priced by the
analytic model (:func:`onnx_partition.cost.annotate.annotate`) on a device spec, and its
backward two ways: the one factor per ONNX node (2 for dense operators, 1 for the rest) and per
aten op of the program (:mod:`onnx_partition.cost.aten`); beside them, torch eager's whole
program backward over its forward (``profile --mode train``'s calibration figures, one thread).
The device spec is the fixed CPU one (50 GFLOP/s, 10 GB/s, 5 us per op) and the H100's, so
that the ratio says how each rule splits a step, not how fast this machine is.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from onnx_partition import models
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import annotate
from onnx_partition.cost.aten import backward_per_node
from onnx_partition.cost.devices import device_for
from onnx_partition.cost.profile.torch_ops import profile_train
from onnx_partition.graph import load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="resnet,inception,unet,gpt,bert,encdec")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    specs = {"cpu": DeviceSpec.cpu(), "h100": device_for("cuda", "h100")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes.split(","):
            model = models.export(recipe, Path(tmp) / f"{recipe}.onnx", size=args.size)
            graph = load(model, batch_size=args.batch_size)
            program = torch.export.load(str(model.with_suffix(".pt2")))
            row = {"recipe": recipe}
            for name, spec in specs.items():
                costs = annotate(graph, device=spec)
                forward = sum(costs.forward_ms)
                row[f"{name}_factor"] = sum(costs.backward_ms) / forward
                row[f"{name}_aten"] = sum(backward_per_node(graph, program, spec)) / forward
            measured = profile_train(graph, program, repeats=args.repeats, warmup=1)
            row["torch"] = measured.whole_backward_ms / measured.whole_forward_ms
            rows.append(row)
            print(f"done {recipe}", file=sys.stderr, flush=True)
    print(f"{args.size} recipes, {args.batch_size} rows, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("\n| recipe | CPU spec: factor | CPU spec: per aten op | H100: factor | "
          "H100: per aten op | torch eager CPU, measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['recipe']} | {r['cpu_factor']:.2f} | {r['cpu_aten']:.2f} | "
              f"{r['h100_factor']:.2f} | {r['h100_aten']:.2f} | {r['torch']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
