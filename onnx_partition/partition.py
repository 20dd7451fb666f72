"""The partitioner's pipeline: load -> annotate -> order -> solve -> emit.

Each step lives in its own module; this one wires them together and turns the solver's answer
(plain arrays) back into a :class:`~onnx_partition.plan.Plan`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from onnx_partition import __version__
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import NodeCosts, annotate
from onnx_partition.emit import StageCut, cut_stages, emit, io_specs
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load
from onnx_partition.order.topo import cut_bytes
from onnx_partition.plan import Plan, Predicted, Stage
from onnx_partition.solve.dp import split_sequence, stage_times


@dataclass(frozen=True)
class Flow:
    """The DAG as plain arrays over the cut (non-free) nodes, numbered 0..n-1.

    ``producer[t]`` is -1 for a graph input; ``nodes[i]`` is the OpGraph index of node i.
    """

    nodes: list[int]
    compute_ms: list[float]
    producer: list[int]
    consumers: list[list[int]]
    is_output: list[bool]
    nbytes: list[float]
    names: list[str]


def flow_of(graph: OpGraph, forward_ms: Sequence[float]) -> Flow:
    """Plain arrays of ``graph`` for the solvers."""
    nodes = graph.compute_nodes
    local = {g: i for i, g in enumerate(nodes)}
    names = list(graph.tensors)
    outputs = set(graph.outputs)
    return Flow(
        nodes=nodes,
        compute_ms=[forward_ms[g] for g in nodes],
        producer=[local.get(graph.tensors[t].producer, -1) for t in names],
        consumers=[[local[c] for c in graph.tensors[t].consumers] for t in names],
        is_output=[t in outputs for t in names],
        nbytes=[float(graph.tensors[t].nbytes) for t in names],
        names=names,
    )


@dataclass(frozen=True)
class Link:
    """The link between neighbouring stages."""

    bandwidth_gbps: float = 10.0  # GB/s; CPU processes on one machine copy at memory speed
    latency_ms: float = 0.02

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbps * 1e6 if self.bandwidth_gbps > 0 else math.inf


def partition(
    model: str | os.PathLike[str],
    num_stages: int,
    out: str | os.PathLike[str],
    *,
    costs: str | os.PathLike[str] | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    batch_size: int | None = None,
    device: DeviceSpec | None = None,
    link: Link | None = None,
    force: bool = False,
    check: bool = True,
) -> Plan:
    """Cut ``model`` into ``num_stages`` pipeline stages and write them with plan.json to ``out``.

    Returns the plan as written. Raises :class:`PartitionError` on bad input.
    """
    started = time.perf_counter()
    graph = load(model, input_shapes=input_shapes, batch_size=batch_size)
    node_costs = annotate(graph, device=device, costs_path=costs)
    plan, cuts = plan_stages(graph, node_costs, num_stages, link=link or Link())
    plan.extra["partition_s"] = round(time.perf_counter() - started, 4)
    return emit(graph, cuts, plan, Path(out), force=force, check=check)


def plan_stages(
    graph: OpGraph, node_costs: NodeCosts, num_stages: int, *, link: Link
) -> tuple[Plan, list[StageCut]]:
    """Order the graph topologically, cut the order by DP, and describe the stages."""
    flow = flow_of(graph, node_costs.forward_ms)
    n = len(flow.nodes)
    if not 1 <= num_stages <= n:
        raise PartitionError(
            f"--stages {num_stages} is not possible: the model has {n} operators to cut"
        )
    order = list(range(n))  # graph.nodes is already a topological order
    cuts_b = cut_bytes(order, flow.producer, flow.consumers, flow.is_output, flow.nbytes)
    compute = [flow.compute_ms[i] for i in order]
    split = split_sequence(compute, cuts_b, num_stages, bandwidth_bytes_per_ms=link.bytes_per_ms,
                           latency_ms=link.latency_ms)
    stage_of = {
        flow.nodes[order[pos]]: k
        for k, (i, j) in enumerate(zip(split.bounds, split.bounds[1:]))
        for pos in range(i, j)
    }
    cuts = cut_stages(graph, stage_of, num_stages)
    compute_only = stage_times(compute, [0.0] * (n + 1), split.bounds)
    stages = []
    for k, cut in enumerate(cuts):
        params = sum(graph.initializer_bytes[t] for t in cut.initializers)
        io = sum(graph.tensors[t].nbytes for t in cut.inputs + cut.outputs if t in graph.tensors)
        stages.append(Stage(
            index=k,
            file=f"stage_{k}.onnx",
            nodes=[graph.nodes[i].key for i in cut.nodes],
            inputs=cut.inputs,
            outputs=cut.outputs,
            constants=[graph.nodes[i].key for i in cut.constants],
            predicted=Predicted(
                compute_ms=round(compute_only[k], 6),
                comm_ms=round(split.stage_ms[k] - compute_only[k], 6),
                memory_bytes=params + io,
            ),
        ))
    inputs, outputs = io_specs(graph)
    bottleneck = split.bottleneck_ms
    plan = Plan(
        model=str(graph.path) if graph.path else "",
        stages=stages,
        inputs=inputs,
        outputs=outputs,
        predicted={
            "bottleneck_ms": round(bottleneck, 6),
            "throughput_per_s": round(1000.0 / bottleneck, 3) if bottleneck > 0 else math.inf,
            "total_compute_ms": round(sum(compute), 6),
        },
        extra={
            "version": __version__,
            "costs": {"source": node_costs.source, "measured_nodes": node_costs.measured},
            "input_shapes": {k: list(v) for k, v in graph.input_shapes.items()},
            "link": {"bandwidth_gbps": link.bandwidth_gbps, "latency_ms": link.latency_ms},
            "unknown_size_tensors": len(graph.unknown_size),
        },
    )
    return plan, cuts
