"""The hybrid planner at scale: planning time and memory on transformer-shaped graphs of 10k
and 100k operators for a 1,024-device training cluster (issue 22).

    python tools/bench_scale.py [--layers 511 5110] [--machines 128] [--microbatches 8]
        [--simulator STAGES]

A synthetic transformer: ``layers`` blocks of 20 operators each (layer norm, Q/K/V
projections, scores, softmax, context, output projection, residual add, layer norm, MLP up,
GELU, MLP down, residual add, and the reshapes between), ~4.4 k parameters per layer (22.5M
over 5,110 layers, as in the issue's 102,200-operator graph), planned by ``plan_cluster`` on
``machines`` x 8 H100-class devices (80 GB, NVLink inside a machine, 200 Gb/s between),
training with 1F1B. Prints a Markdown table: operators, devices, planning time (wall, one
run) and its CPU seconds (the process's: less bound to the load), peak resident memory of the
process (``ru_maxrss``, which only grows: each row is at least the previous), the plan's
depth, replicas, devices used, simulated iteration and bubble,
the closed form the planner ranks proposals by (fill and drain, then the busiest replica's
other ``ceil(M / r) - 1`` micro-batches at the slowest stage, then the slowest all-reduce) over
the simulated iteration, and the planner's lines on devices.

``--simulator STAGES``: first a table of one plan of ``STAGES`` stages x 4 replicas (one
layer's costs each, sends of a hidden activation) at ``--microbatches``, per schedule: seconds
of the event simulation of the built schedule (``simulate(build(...))``) and of the planner's
scorer (``simulate_schedule``), and whether every figure is equal.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import replace

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec

#: (name, forward ms, parameters) of one layer's operators, in order; each reads the one
#: before it, and the two residual adds also read the layer's input / the attention's output.
LAYER = [("ln1", 0.004, 64), ("q", 0.02, 1024), ("k", 0.02, 1024), ("v", 0.02, 1024),
         ("reshape_q", 0.001, 0), ("reshape_k", 0.001, 0), ("reshape_v", 0.001, 0),
         ("scores", 0.03, 0), ("scale", 0.002, 0), ("softmax", 0.006, 0), ("context", 0.03, 0),
         ("merge", 0.001, 0), ("proj", 0.02, 1024), ("add1", 0.003, 0), ("ln2", 0.004, 64),
         ("up", 0.04, 0), ("gelu", 0.008, 0), ("down", 0.04, 160), ("add2", 0.003, 0),
         ("drop", 0.002, 0)]
HIDDEN_BYTES = 8 * 128 * 64 * 4  # a [batch 8, 128 tokens, 64 features] float32 activation


#: what each operator of a layer reads, by its index in LAYER (-1: the layer's input)
READS = {0: [-1], 1: [0], 2: [0], 3: [0], 4: [1], 5: [2], 6: [3], 7: [4, 5], 10: [9, 6],
         13: [12, -1], 18: [17, 13]}


def transformer(layers: int) -> tuple[DagProblem, NodeArrays]:
    """``layers`` x 20 operators in a chain of layers. Tensor 0 is the graph input, tensor
    ``v + 1`` node ``v``'s output (so a layer starting at node ``b`` reads tensor ``b``)."""
    nodes = layers * len(LAYER)
    producer = [-1, *range(nodes)]
    consumers: list[list[int]] = [[] for _ in producer]
    compute, params, names = [], [], []
    for layer in range(layers):
        base = layer * len(LAYER)
        for k, (name, ms, p) in enumerate(LAYER):
            compute.append(ms)
            params.append(4.0 * p)
            names.append(f"/layers.{layer}/{name}")
            for read in READS.get(k, [k - 1]):
                consumers[base + read + 1].append(base + k)
    outputs = [False] * nodes + [True]
    link = Link(300.0, 0.005)
    problem = DagProblem(compute, producer, consumers, outputs, [float(HIDDEN_BYTES)] * (
        nodes + 1), link.bytes_per_ms, link.latency_ms)
    return problem, NodeArrays([2.0 * c for c in compute], params,
                               [float(HIDDEN_BYTES)] * nodes, names)


def closed_form_ms(plan: HybridPlan, microbatches: int) -> float:
    """:func:`~onnx_partition.solve.planner.estimate_ms` of a scored plan's stage costs."""
    send = [0.0, *plan.costs.send_ms, 0.0]
    latency = [s.forward_ms + s.backward_ms + 2 * (send[k] + send[k + 1])
               for k, s in enumerate(plan.costs.stages)]
    rest = max((-(-microbatches // s.replicas) - 1) * lat
               for s, lat in zip(plan.costs.stages, latency, strict=True))
    return sum(latency) + rest + max(s.allreduce_ms for s in plan.costs.stages)


def simulator_table(stages: int, microbatches: int) -> None:
    """Print the event simulation's and the scorer's seconds for one plan per schedule."""
    # imported here: the planning table also runs on a tree without the scorer (before/after)
    from onnx_partition.pipeline.schedules import build
    from onnx_partition.pipeline.simulate import (
        PipelineCosts,
        StageCosts,
        simulate,
        simulate_schedule,
    )

    forward = sum(ms for _, ms, _ in LAYER)
    costs = PipelineCosts(
        [StageCosts(forward, 2.0 * forward, 4, allreduce_ms=0.5, activation_bytes=HIDDEN_BYTES,
                    step_ms=0.1, accumulate_ms=0.01, action_ms=0.002) for _ in range(stages)],
        [HIDDEN_BYTES / 3e5 + 0.005] * (stages - 1))
    replicas = [4] * stages
    print("| schedule | stages x replicas | M | actions | simulate(build) s | "
          "simulate_schedule s | ratio | equal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("gpipe", "1f1b", "zb-h1"):
        began = time.perf_counter()
        full = simulate(build(name, replicas, microbatches), costs)
        mid = time.perf_counter()
        fast = simulate_schedule(name, replicas, microbatches, costs)
        end = time.perf_counter()
        print(f"| {name} | {stages} x 4 | {microbatches} | {len(full.timeline):,} "
              f"| {mid - began:.3f} | {end - mid:.3f} | {(mid - began) / (end - mid):.1f} "
              f"| {replace(full, timeline=[]) == fast} |", flush=True)
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[511, 5110])
    parser.add_argument("--machines", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--simulator", type=int, metavar="STAGES",
                        help="first time one plan of STAGES stages in both simulators")
    args = parser.parse_args()
    if args.simulator:
        simulator_table(args.simulator, args.microbatches)
    cluster = Cluster(machines=args.machines, devices_per_machine=8, memory_gb=80.0,
                      kind="cuda", intra=Link(300.0, 0.005), inter=Link(25.0, 0.02))
    run = RunSpec(cluster, train=True, microbatches=args.microbatches)
    print("| operators | devices | M | planning s | CPU s | peak RSS GB | stages | replicas "
          "| used | iteration ms | closed form / simulated | bubble | devices lines |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        problem, arrays = transformer(layers)
        started, cpu = time.perf_counter(), time.process_time()
        plan, _ = plan_cluster(problem, arrays, run)
        took, cpu = time.perf_counter() - started, time.process_time() - cpu
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        note = "<br>".join(plan.notes)
        closed = closed_form_ms(plan, run.microbatches) / plan.sim.iteration_ms
        print(f"| {problem.num_nodes:,} | {cluster.devices:,} | {run.microbatches} | {took:.2f} "
              f"| {cpu:.2f} | {rss:.2f} | {plan.num_stages} | {plan.replicas} "
              f"| {sum(plan.replicas)} "
              f"| {plan.sim.iteration_ms:.3f} | {closed:.3f} | {plan.sim.bubble_fraction:.1%} "
              f"| {note} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
