"""Freeze a model's planning problem (the solvers' plain arrays) into a small JSON file.

    python tools/problem_fixture.py MODEL.onnx --batch-size 8 -o tests/data/NAME.json.gz
    python tools/problem_fixture.py MODEL.onnx --batch-size 8 --ops -o tests/data/NAME.json.gz

The DagProblem and NodeArrays that ``partition`` builds (analytic costs of the generic CPU
spec, ``DeviceSpec.cpu()``, as ``partition`` priced them before the GPU device model), so a test
can plan exactly the issue's case without exporting the model (GPT-2 medium takes minutes).
:func:`load_fixture` reads it back. With ``--ops``: every compute node's analytic view
(:class:`~onnx_partition.cost.analytic.OpInfo`: type, shapes, item sizes, plain attributes)
instead, for roofline tests on a real model's operators.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import annotate, op_infos
from onnx_partition.cost.cluster import Link
from onnx_partition.graph import load
from onnx_partition.graph_arrays import dag_problem
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, node_arrays

CPU_AS_BEFORE = DeviceSpec("cpu", peak_gflops=50.0, mem_gbps=10.0, launch_overhead_ms=0.005)


def dump(model: Path, batch_size: int, out: Path) -> None:
    graph = load(model, batch_size=batch_size)
    costs = annotate(graph, device=CPU_AS_BEFORE)
    problem, nodes = dag_problem(graph, costs.forward_ms, Link())
    body = {
        "model": model.name, "batch_size": batch_size, "costs": costs.source,
        "compute_ms": problem.compute_ms, "producer": problem.producer,
        "consumers": problem.consumers, "is_output": problem.is_output,
        "nbytes": problem.nbytes,
        "backward_ms": [costs.backward_ms[g] for g in nodes],
        "param_bytes": [float(graph.nodes[g].param_bytes) for g in nodes],
    }
    tmp = out.with_name(f".{out.name}.tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(body, f)
    tmp.replace(out)


def dump_ops(model: Path, batch_size: int, out: Path) -> None:
    graph = load(model, batch_size=batch_size)
    ops = []
    for node, info in zip(graph.nodes, op_infos(graph)):
        if node.free:
            continue
        attrs = {k: v for k, v in info.attrs.items() if isinstance(v, int | float | str | list)}
        ops.append({"op_type": info.op_type, "attrs": attrs,
                    "input_shapes": info.input_shapes, "output_shapes": info.output_shapes,
                    "input_itemsizes": info.input_itemsizes,
                    "output_itemsizes": info.output_itemsizes})
    tmp = out.with_name(f".{out.name}.tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump({"model": model.name, "batch_size": batch_size, "ops": ops}, f)
    tmp.replace(out)


def load_fixture(path: Path) -> tuple[DagProblem, NodeArrays]:
    with gzip.open(path, "rt") as f:
        body = json.load(f)
    link = Link()
    problem = DagProblem(body["compute_ms"], body["producer"], body["consumers"],
                         body["is_output"], body["nbytes"], link.bytes_per_ms, link.latency_ms)
    return problem, node_arrays(problem, body["backward_ms"], body["param_bytes"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ops", action="store_true", help="dump operators, not the problem")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    (dump_ops if args.ops else dump)(args.model, args.batch_size, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
