"""The hybrid DP's objective against the simulated iteration the plan is chosen by (issue 36
item 4): where they part, and what the proof record now bounds.

    python tools/bench_objective.py [--recipes gpt resnet inception unet] [--sizes small]
        [--devices 4 8] [--scale-layers 64] [--scale-machines 2] [--scale-m 8 32 256]
        [--setting pcie]

Cases: each recipe at each size on each device count, training with 1F1B at 16 micro-batches
(``tools/bench_planner.py``'s graphs, costs and settings), then ``tools/bench_scale.py``'s
transformer (``--scale-layers`` layers) on ``--scale-machines`` x 8 H100-class devices at each
of ``--scale-m`` micro-batch counts. Per case the planner's plan (:func:`plan_cluster`) and
:func:`~onnx_partition.solve.hybrid_proof.prove_hybrid` with the planner's proposals (so the
bound is computed beyond the judge's 8 devices too). Columns: the DP's least bottleneck period
``P*`` over the plan's ordering, ``M P*``, the DP's own closed form for its best plan (fill and
drain: one micro-batch through every stage, the rest at the slowest, the all-reduce:
``planner.estimate_ms``), the chosen plan's simulated iteration and its ratio to ``M P*``, the
chosen plan's own ``M x period`` and its :func:`~onnx_partition.solve.scoring.lower_bound_ms`,
the record's iteration bound (over every split of the sequence) and ``gap``, the proof's
``by``, and what the plan spends off its bottleneck: the exposed all-reduce (the slowest
stage's) and the boundaries priced at the inter-machine link; the tournament's seconds and the
proof's (the bound, and CP-SAT where it runs); the tournament's are ``plan_cluster``'s given the
proposals (made before, not counted). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_planner import MICROBATCHES, SETTINGS, cluster_for, recipe_problem
from bench_scale import transformer

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.solve.hybrid_proof import prove_hybrid
from onnx_partition.solve.planner import (
    HYBRID_ORDERINGS,
    estimate_ms,
    plan_cluster,
    proposals_for,
)
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec, lower_bound_ms, stage_totals

HEADER = ("| case | D | M | plan | P* ms | M P* | DP closed form | simulated | sim / M P* | "
          "plan M x period | plan's own bound | iteration bound | gap | by | all-reduce "
          "exposed | inter boundaries | tournament s | proof s |")


def row(name: str, problem: DagProblem, arrays: NodeArrays, run: RunSpec) -> str:
    """One case's line of the table."""
    m = run.microbatches
    proposals = proposals_for(problem, arrays, run, None, HYBRID_ORDERINGS)
    try:
        plan, _ = plan_cluster(problem, arrays, run, proposals=proposals)
    except PartitionError as error:
        return f"| {name} | {run.cluster.devices} | {m} | {error} |" + " |" * 15
    proof = prove_hybrid(problem, arrays, run, plan, proposals=proposals)
    ordering = plan.source.partition(":")[2] or HYBRID_ORDERINGS[0]
    solved = next((p.solved for p in proposals
                   if p.solved is not None and p.solved.ordering == ordering), None)
    best = solved.plans[0] if solved is not None and solved.plans else None
    period = max(s.period_ms for s in best) if best else None
    sim = plan.sim.iteration_ms
    own = lower_bound_ms(plan.costs, m, run.train, split=run.schedule == "zb-h1")
    intra = run.cluster.intra
    cross = stage_totals(problem, arrays, plan.stage_of, plan.num_stages).cross_bytes
    inter = sum(1 for sent, nbytes in zip(plan.costs.send_ms, cross, strict=True)
                if sent > (nbytes / intra.bytes_per_ms + intra.latency_ms) * (1 + 1e-9))
    allreduce = max(s.allreduce_ms for s in plan.costs.stages)

    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.4g}"

    plan_m = None if proof.plan_period_ms is None else proof.plan_period_ms * m
    gap = proof.iteration_gap
    return (f"| {name} | {run.cluster.devices} | {m} | {'x'.join(map(str, plan.replicas))} | "
            f"{ms(period)} | {ms(period * m if period else None)} | "
            f"{ms(estimate_ms(best, run) if best else None)} | {ms(sim)} | "
            f"{'' if not period else f'{sim / (period * m):.3f}'} | {ms(plan_m)} | {ms(own)} | "
            f"{ms(proof.iteration_bound_ms)} | {'' if gap is None else f'{gap:.2%}'} | "
            f"{proof.by} | {ms(allreduce)} | {inter} | {plan.planning_s:.2f} | "
            f"{proof.seconds:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=["gpt", "resnet", "inception", "unet"])
    parser.add_argument("--sizes", nargs="*", default=["small"])
    parser.add_argument("--devices", nargs="*", type=int, default=[4, 8])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="pcie")
    parser.add_argument("--scale-layers", type=int, default=64)
    parser.add_argument("--scale-machines", type=int, default=2)
    parser.add_argument("--scale-m", nargs="*", type=int, default=[8, 32, 256])
    args = parser.parse_args()
    setting = SETTINGS[args.setting]
    print(HEADER)
    print("|" + " --- |" * (HEADER.count("|") - 1))
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for name in args.recipes:
                problem, arrays = recipe_problem(name, size, Path(tmp), setting)
                for devices in args.devices:
                    run = RunSpec(cluster_for(devices, setting), train=True,
                                  microbatches=MICROBATCHES)
                    print(row(f"{name}-{size}", problem, arrays, run), flush=True)
    if args.scale_m:
        problem, arrays = transformer(args.scale_layers)
        cluster = Cluster(machines=args.scale_machines, devices_per_machine=8, memory_gb=80.0,
                          kind="cuda", intra=Link(300.0, 0.005), inter=Link(25.0, 0.02))
        for m in args.scale_m:
            run = RunSpec(cluster, train=True, microbatches=m)
            print(row(f"scale-{args.scale_layers}L", problem, arrays, run), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
