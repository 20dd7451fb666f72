"""Mixed fleets: the fleet planner against its two baselines, simulated, one run.

    python tools/bench_fleet.py [--size realistic|small] [--recipes gpt resnet ...]
        [--modes train infer] [--precisions tf32 half] [--cache DIR] [--engine]
        [--memory-gb G]

The fleet: 4 A100-80GB on one machine (NVLink, 300 GB/s) and 4 V100-32GB on another (NVLink,
150 GB/s), 25 GB/s (200 Gb/s InfiniBand) between them (cluster@2 ``groups``). Every node is
priced on each kind by its datasheet roofline (``cost/devices.py``): ``tf32`` prices float32
matrix products at the A100's TF32 and the V100's fp32 peaks (what onnxruntime and PyTorch do
by default), ``half`` at both GPUs' fp16/bf16 tensor-core peaks (mixed precision).

Baselines, each the one-kind planner (``plan_cluster``) as a user would run it today:
*fastest group* plans each machine alone and keeps the faster (the A100 one, or the V100 one
where it wins); *as slowest* describes all 8 devices as the slowest kind (node by node the
slower time, the smaller memory, the slower machine link) and reports the iteration it
predicts there. Both come from the very calls ``plan_fleet`` makes
(``solve.fleet.fastest_alone`` and ``as_slowest`` state them on their own).
Ours: ``solve.fleet.plan_fleet`` (its DP over group orderings, each group alone, and the
as-slowest plan placed on the fleet, all simulated on the fleet). Columns: simulated
iteration ms (lower is better), ours / baseline speed-up, our plan (stages as
``replicas x gpu``), planning seconds. Invoked by ``tools/bench_planner.py --fleet``.

``--engine``: train rows priced as ``partition --mode train`` prices a fleet: each stage's
optimizer step, accumulation and engine work on its own kind (``cost.engine_price.engine_terms`` on
the kind's roofline, AdamW), planned for 1F1B and ZB-H1 (each kind's input-gradient split), the
faster kept; the baselines likewise (our plan then names its schedule).

``--memory-gb G``: every device holds ``G`` GB, where memory binds; train rows recompute per
stage where keeping does not fit (``--recompute auto``), our plan marking such a stage ``*``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from onnx_partition import models
from onnx_partition.cost.annotate import annotate
from onnx_partition.cost.cluster import Fleet, GpuGroup, Link
from onnx_partition.cost.devices import gpu
from onnx_partition.cost.engine_price import engine_terms
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.graph_arrays import dag_problem, grad_input_ms
from onnx_partition.pipeline.schedules import PLANNED_NAMES
from onnx_partition.solve.fleet import FleetPlan, KindCosts, plan_fleet
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec, node_arrays

BATCH, MICROBATCHES = 8, 16
PRECISIONS = {"tf32": ("a100-80gb", "v100"), "half": ("a100-80gb:bf16", "v100:fp16")}


def fleet_for(precision: str, memory_gb: float | None = None) -> Fleet:
    """The fleet; ``memory_gb``: every device's memory (None: each datasheet's)."""
    fast, slow = PRECISIONS[precision]
    return Fleet(groups=(GpuGroup(fast, 1, 4, memory_gb, Link(300.0, 0.005)),
                         GpuGroup(slow, 1, 4, memory_gb, Link(150.0, 0.005))),
                 inter=Link(25.0, 0.02))


def recipe(name: str, size: str, cache: Path, fleet: Fleet, engine: bool = False
           ) -> tuple[DagProblem, NodeArrays, dict[str, KindCosts]]:
    """Export (cached), load at batch 8, every node priced on each kind of ``fleet``
    (``engine``: with each kind's engine terms and input-gradient split)."""
    path = cache / f"{name}-{size}.onnx"
    if not path.exists():
        models.export(name, path, size=size)
    graph = load(path, batch_size=BATCH)
    priced = {kind: annotate(graph, device=gpu(kind)) for kind in fleet.kinds}
    first = priced[fleet.kinds[0]]
    problem, nodes = dag_problem(graph, first.forward_ms, fleet.intra)
    arrays = node_arrays(problem, [first.backward_ms[g] for g in nodes],
                         [float(graph.nodes[g].param_bytes) for g in nodes],
                         [graph.nodes[g].key for g in nodes])
    kinds = {k: KindCosts([c.forward_ms[g] for g in nodes], [c.backward_ms[g] for g in nodes],
                          engine_terms(None, gpu(k), "adamw") if engine else None,
                          [grad_input_ms(graph, c, None)[g] for g in nodes] if engine else [])
             for k, c in priced.items()}
    return problem, arrays, kinds


def shape(plan: FleetPlan, schedule: bool = False) -> str:
    """``4xa100-80gb > 4xv100``: each stage's replicas and kind, in pipeline order, ``*``
    after a stage that recomputes (and ``schedule``: ``, zb-h1``)."""
    return " > ".join(f"{r}x" + "+".join(k.split(":")[0] for k in g.split("+"))
                      + ("*" if c.recompute else "")
                      for r, g, c in zip(plan.replicas, plan.gpus, plan.costs.stages)) + (
        f", {plan.schedule}" if schedule else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=models.SIZES)
    parser.add_argument("--recipes", nargs="*", default=list(models.RECIPES))
    parser.add_argument("--modes", nargs="*", default=["train", "infer"],
                        choices=["train", "infer"])
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS),
                        choices=list(PRECISIONS))
    parser.add_argument("--cache", type=Path, default=None, help="keep exports here")
    parser.add_argument("--engine", action="store_true",
                        help="price train rows as partition does: each kind's engine work, "
                             "1F1B and ZB-H1")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="every device's memory (default: each datasheet's), where "
                             "memory binds and stages recompute (--recompute auto)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        run_all(args, cache)
    return 0


def run_all(args: argparse.Namespace, cache: Path) -> None:
    print(f"### Mixed fleet: 4 A100-80GB + 4 V100-32GB\n\nSize {args.size}"
          + ("; train rows with each kind's engine work, 1F1B or ZB-H1" if args.engine else "")
          + (f"; {args.memory_gb} GB per device (`*`: the stage recomputes)"
             if args.memory_gb else "")
          + f"; batch {BATCH} per "
          f"micro-batch, {MICROBATCHES} micro-batches per iteration; simulated iteration ms "
          "(1F1B in training, forward streaming in inference); speed-up = baseline ms / ours "
          "ms (>= 1: ours at least as fast).\n")
    print("| recipe | precision | mode | ours ms | fastest group ms | as slowest ms | "
          "vs fastest | vs slowest | our plan | ours s |")
    print("| --- " * 10 + "|")
    worst = {"fastest group": float("inf"), "as slowest": float("inf")}
    wins = {"fastest group": 0, "as slowest": 0}
    rows = 0
    for name in args.recipes:
        for precision in args.precisions:
            fleet = fleet_for(precision, args.memory_gb)
            problem, arrays, kinds = recipe(name, args.size, cache, fleet, args.engine)
            for mode in args.modes:
                run = RunSpec(fleet.clusters[0], train=mode == "train",
                              microbatches=MICROBATCHES,
                              recompute="auto" if args.memory_gb else "none")
                began = time.perf_counter()
                try:
                    ours, families = plan_fleet(
                        problem, arrays, kinds, fleet, run,
                        schedules=PLANNED_NAMES if args.engine and run.train else ())
                except PartitionError:
                    ours, families = None, {}
                spent = time.perf_counter() - began
                # the baselines, as plan_fleet planned them (the same one-kind planner calls)
                base = {"fastest group": min(
                            (v["iteration_ms"] for k, v in families.items()
                             if k.startswith("alone:")), default=float("inf")),
                        "as slowest": families.get("as-slowest", {}).get(
                            "planned_ms", float("inf"))}
                ms = ours.sim.iteration_ms if ours else float("inf")
                cells = []
                for label in ("fastest group", "as slowest"):
                    ratio = base[label] / ms
                    worst[label] = min(worst[label], ratio)
                    wins[label] += ratio > 1.001
                    cells.append(f"{ratio:.2f}x")
                rows += 1
                ours_shape = shape(ours, args.engine and run.train) if ours else "none fits"
                print(f"| {name} | {precision} | {mode} | {ms:.3f} | "
                      f"{base['fastest group']:.3f} | {base['as slowest']:.3f} | "
                      f"{' | '.join(cells)} | {ours_shape} | {spent:.2f} |", flush=True)
    print()
    for label in worst:
        print(f"vs {label}: worst speed-up {worst[label]:.3f}x (target >= 1), faster in "
              f"{wins[label]} of {rows} rows")


if __name__ == "__main__":
    raise SystemExit(main())
