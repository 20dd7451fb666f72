"""The planner's memory against the stage files' for one cut of a real graph (issue 20).

:func:`planner_inputs` builds what ``partition`` hands the planner (units, the one count's
arrays); :func:`both_counts` counts one cut both ways: :func:`~onnx_partition.partition.
stage_sizes` over the stage files' cuts (what the plan states and ``simulate`` and ``report``
replay), the scorer's per-stage sums (:func:`~onnx_partition.solve.scoring.pipeline_costs`)
and the hybrid DP's interval tables (:func:`~onnx_partition.solve.hybrid.stage_memory`).
``tools/memory_agreement.py`` tallies the same over many cuts.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.graph import OpGraph
from onnx_partition.graph.emit import cut_stages
from onnx_partition.graph_arrays import per_unit as _per_unit
from onnx_partition.graph_arrays import stage_sizes, unit_problem, unit_weights
from onnx_partition.pipeline.memory import StageBytes, memory_per_device
from onnx_partition.solve.contract import expand
from onnx_partition.solve.hybrid import HybridConfig, stage_memory
from onnx_partition.solve.order.blocks import Blocks
from onnx_partition.solve.order.topo import assign
from onnx_partition.solve.planner import sequence_costs
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.scoring import (
    NodeArrays,
    RunSpec,
    node_arrays,
    pipeline_costs,
    stage_totals,
)

__all__ = ["PARTS", "Counts", "Inputs", "both_counts", "planner_inputs"]

#: The terms of a stage's memory compared one by one.
PARTS = ("params", "trained", "activations", "received", "sent")


@dataclass(frozen=True)
class Inputs:
    """What the planner gets for one graph: its units' problem and arrays."""

    graph: OpGraph
    problem: DagProblem
    nodes: list[int]
    members: list[list[int]]
    arrays: NodeArrays
    trainable: Collection[str] | None
    order: list[int]  # a topological order of the units, cut contiguously


def planner_inputs(graph: OpGraph, trainable: Collection[str] | None = None) -> Inputs:
    """The units and arrays ``partition`` plans a graph with (unit times 1 ms; activations
    every output, as without a program)."""
    problem, nodes, members = unit_problem(graph, [1.0] * len(graph.nodes), Link(10.0, 0.02))
    arrays = node_arrays(problem, [0.0] * problem.num_nodes,
                         _per_unit([float(graph.nodes[g].param_bytes) for g in nodes], members),
                         [graph.nodes[nodes[m[0]]].key for m in members])
    arrays = replace(arrays, **unit_weights(graph, nodes, members, trainable))
    return Inputs(graph, problem, nodes, members, arrays, trainable,
                  topological_order(problem))


@dataclass(frozen=True)
class Counts:
    """One cut counted both ways: per stage the stage files' parts and the planner's, and the
    memory per device of each (files; scorer; the DP's tables)."""

    files: list[StageBytes]
    planner: list[StageBytes]
    file_memory: list[float]
    scoring_memory: list[float]
    sequence_memory: list[float]

    def disagreements(self) -> list[tuple[int, str, float]]:
        """(stage, part, planner minus files) for every part and memory figure that differ."""
        out = []
        for k, (f, p) in enumerate(zip(self.files, self.planner, strict=True)):
            out += [(k, part, getattr(p, part) - getattr(f, part)) for part in PARTS
                    if getattr(p, part) != getattr(f, part)]
        for name, memory in (("scoring", self.scoring_memory),
                             ("sequence", self.sequence_memory)):
            out += [(k, name, m - f) for k, (m, f) in enumerate(zip(
                memory, self.file_memory, strict=True)) if m != f]
        return out


def both_counts(inputs: Inputs, bounds: Sequence[int], *, train: bool,
                microbatches: int = 4) -> Counts:
    """The cut of ``inputs.order`` at ``bounds`` (``0 < b1 < ... < n``: positions of the
    order), one replica per stage, counted by the stage files and by the planner."""
    problem, arrays = inputs.problem, inputs.arrays
    stages = len(bounds) - 1
    stage_of = assign(inputs.order, bounds)
    cuts = cut_stages(inputs.graph, {inputs.nodes[i]: k for i, k in enumerate(expand(
        stage_of, inputs.members, len(inputs.nodes)))}, stages)
    files = stage_sizes(inputs.graph, cuts, train=train, trainable=inputs.trainable)
    totals = stage_totals(problem, arrays, stage_of, stages)
    assert totals.weight_bytes is not None and totals.trainable_bytes is not None
    cross = [totals.input_bytes, *totals.cross_bytes, 0.0]
    planner = [StageBytes(float(totals.weight_bytes[k]), float(totals.activation_bytes[k]),
                          cross[k], cross[k + 1] if train else 0.0,
                          float(totals.trainable_bytes[k])) for k in range(stages)]
    schedule = "1f1b" if train else "infer"
    file_memory = memory_per_device(files, [1] * stages, microbatches if train else 1,
                                    schedule=schedule)
    _, scoring = pipeline_costs(problem, arrays, stage_of, [1] * stages,
                                RunSpec(Cluster(1, stages), train=train,
                                        microbatches=microbatches))
    blocks = Blocks(list(inputs.order), list(range(problem.num_nodes + 1)))
    sequence = stage_memory(sequence_costs(problem, arrays, blocks),
                            HybridConfig(devices=stages, microbatches=microbatches, train=train),
                            [(i, j, 1) for i, j in itertools.pairwise(bounds)])
    return Counts(files, planner, file_memory, scoring, sequence)
