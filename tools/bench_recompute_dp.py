"""Recomputation chosen per stage inside the hybrid DP against the two-pass approach it replaced.

The two-pass approach ran :func:`~onnx_partition.solve.hybrid.plan_hybrid` twice, every stage
keeping its activations and every stage recomputing, and chose which stages really recompute
afterwards (:func:`~onnx_partition.pipeline.memory.recompute_choice`, as the planner's scoring
does); ``recompute="auto"`` chooses it per stage inside one DP (issue 23). Per recipe and
memory share (of one device's need: the whole model on one device under 1F1B): the DP's
seconds both ways (and of what the planner runs under ``auto``: the per-stage DP, then the
all-recomputing one for more proposals) and the least bottleneck period each reaches (the
DP's objective, the two-pass plans re-flagged per stage), on the planner's first ordering's
sequence. Run::

    python tools/bench_recompute_dp.py --size realistic --recipes inception gpt
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_planner import MICROBATCHES, SETTINGS, cluster_for, recipe_problem

from onnx_partition import models
from onnx_partition.cost.cluster import Cluster
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import StageBytes, memory_per_device
from onnx_partition.solve.hybrid import (
    HybridConfig,
    HybridStage,
    SequenceCosts,
    plan_hybrid,
    price_stages,
)
from onnx_partition.solve.planner import HYBRID_ORDERINGS, dp_sequence
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec
from onnx_partition.solve.search import sequence_for


def timed(plan: Callable[[], list[list[HybridStage]]]
          ) -> tuple[list[list[HybridStage]], float]:
    """``plan()``'s plans (empty where none fits) and its seconds."""
    began = time.perf_counter()
    try:
        plans = plan()
    except PartitionError:
        plans = []
    return plans, time.perf_counter() - began


def period(plan: list[HybridStage]) -> float:
    return max(s.period_ms for s in plan)


def two_passes(costs: SequenceCosts, config: HybridConfig,
               modes: tuple[str, str] = ("none", "all")) -> list[list[HybridStage]]:
    """The approach replaced: every stage keeping, then every stage recomputing; which
    stages really recompute is chosen afterwards (:func:`reflagged`). With ``("auto",
    "all")``: what the planner runs now (``planner._dp_plans``)."""
    found = []
    for mode in modes:
        with contextlib.suppress(PartitionError):
            found += plan_hybrid(costs, replace(config, recompute=mode))
    return found


def reflagged(costs: SequenceCosts, config: HybridConfig,
              plans: list[list[HybridStage]]) -> list[list[HybridStage]]:
    """The plans with each stage recomputing by the planner's rule afterwards
    (:func:`~onnx_partition.pipeline.memory.recompute_choice`: over the memory keeping,
    within it recomputing), those within memory."""
    auto, kept_ones = replace(config, recompute="auto"), []
    for plan in plans:
        spans = [(s.start, s.end, s.replicas) for s in plan]
        kept, rebuilt = (price_stages(costs, auto, spans, [f] * len(spans))
                         for f in (False, True))
        flags = [k.memory_bytes > config.memory_bytes >= r.memory_bytes
                 for k, r in zip(kept, rebuilt, strict=True)]
        priced = price_stages(costs, auto, spans, flags)
        if max(s.memory_bytes for s in priced) <= config.memory_bytes:
            kept_ones.append(priced)
    return kept_ones


def row(name: str, share: float, need: float, problem: DagProblem, arrays: NodeArrays,
        args: argparse.Namespace) -> None:
    """One table row: the recipe's DP sequence at ``share`` of one device's ``need``."""
    setting = SETTINGS[args.setting]
    base = cluster_for(args.devices, setting)
    cluster = Cluster(base.machines, base.devices_per_machine, memory_gb=share * need / 1e9,
                      kind="cuda", intra=setting.intra, inter=setting.inter)
    run = RunSpec(cluster, train=True, microbatches=MICROBATCHES)
    seq = dp_sequence(problem, arrays, run, sequence_for(problem, HYBRID_ORDERINGS[0]))
    costs, config = seq.costs, seq.config
    old = [timed(partial(two_passes, costs, config)) for _ in range(args.repeats)]
    new = [timed(partial(plan_hybrid, costs, replace(config, recompute="auto")))
           for _ in range(args.repeats)]
    both = [timed(partial(two_passes, costs, config, ("auto", "all")))
            for _ in range(args.repeats)]
    old_s, new_s = min(t for _, t in old), min(t for _, t in new)
    both_s = min(t for _, t in both)
    was = min(map(period, reflagged(costs, config, old[0][0])), default=math.inf)
    now = min(map(period, new[0][0]), default=math.inf)
    best = min(new[0][0], key=period) if new[0][0] else []
    print(f"| {name} | {share:.0%} | {share * need / 1e9:.3g} GB | {len(costs.forward_ms)} | "
          f"{old_s:.3f} | {new_s:.3f} | {new_s / old_s:.2f}x | {both_s / old_s:.2f}x | "
          f"{was:.4f} | {now:.4f} | "
          f"{was / now if math.isfinite(now) else math.nan:.4f}x | "
          f"{[k for k, s in enumerate(best) if s.recompute]} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="realistic", choices=models.SIZES)
    parser.add_argument("--recipes", nargs="*", default=["inception", "gpt"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--setting", default="pcie", choices=list(SETTINGS))
    parser.add_argument("--shares", nargs="*", type=float, default=[0.6, 0.35])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    parser.add_argument("--cache", type=Path, default=None, help="keep exports here")
    args = parser.parse_args(argv)
    print(f"Size {args.size}, {args.devices} devices ({args.setting}), {MICROBATCHES} "
          f"micro-batches, the {HYBRID_ORDERINGS[0]} sequence; seconds: best of "
          f"{args.repeats}; period: the DP's least bottleneck period in ms (two passes: "
          "their plans re-flagged per stage; ratio > 1: per stage lower)\n")
    print("| recipe | share | limit | blocks | two passes s | per stage s | time ratio | "
          "planner's (+ all) ratio | two-pass period | per-stage period | period ratio | "
          "recomputing |")
    print("| --- " * 12 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        for name in args.recipes:
            problem, arrays = recipe_problem(name, args.size, cache, SETTINGS[args.setting])
            one = StageBytes(float(sum(arrays.param_bytes)), float(sum(arrays.activation_bytes)))
            need = memory_per_device([one], [1], MICROBATCHES, schedule="1f1b")[0]
            for share in args.shares:
                row(name, share, need, problem, arrays, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
