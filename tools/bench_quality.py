"""Plan quality against the exact optimum: topo-DP, cluster-DP, auto and the default vs the ILP.

    python tools/bench_quality.py [--sizes tiny small] [--stages 2 4 8] [--time-limit 60]
                                  [--exact-budget 1]

For every recipe, size and stage count: the bottleneck of each heuristic as a gap to the ILP's
best plan (the ILP is seeded with the default's plan, so it never reports worse), whether the ILP
proved optimality (else its lower bound is shown as the gap of the default to the bound), and
each one's time. "default" is what ``partition`` returns: auto's cut, then the exact pass
(:func:`onnx_partition.solve.exact.exact_split`, ``--exact-budget`` deterministic seconds; 0
gives auto alone); "proof" is how it was proven (or "-"). Analytic CPU costs, default link
(10 GB/s, 0.02 ms). Prints a Markdown table, the plans the exact pass changed, and a summary.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from onnx_partition import models
from onnx_partition.cost.annotate import annotate
from onnx_partition.cost.cluster import Link
from onnx_partition.graph import load
from onnx_partition.graph_arrays import dag_problem
from onnx_partition.solve.exact import EXACT_BUDGET_S, exact_split
from onnx_partition.solve.ilp import solve_ilp
from onnx_partition.solve.search import best_split, solve_ordering


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=list(models.RECIPES))
    parser.add_argument("--sizes", nargs="*", default=["tiny", "small"])
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--exact-budget", type=float, default=EXACT_BUDGET_S)
    args = parser.parse_args()
    print("| recipe | size | nodes | S | ILP ms | optimal | topo-DP gap | cluster-DP gap | "
          "auto gap | default gap | proof | default vs bound | topo-DP s | cluster-DP s | "
          "auto s | exact s | ILP s |")
    print("| --- " * 17 + "|")
    gaps: list[float] = []
    auto_gaps: list[float] = []
    changed: list[str] = []
    worse_than_topo = 0
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for name in args.recipes:
                path = models.export(name, Path(tmp) / f"{name}-{size}.onnx", size=size)
                graph = load(path, batch_size=args.batch_size)
                problem, _ = dag_problem(graph, annotate(graph).forward_ms, Link())
                for stages in args.stages:
                    topo = solve_ordering(problem, stages, "topo", polish=False)
                    cluster = solve_ordering(problem, stages, "cluster", polish=False)
                    began = time.perf_counter()
                    auto, _ = best_split(problem, stages)
                    auto_s = time.perf_counter() - began
                    proof = exact_split(problem, stages, auto.stage_of,
                                        budget_s=args.exact_budget)
                    default = proof.bottleneck_ms
                    ilp = solve_ilp(problem, stages, time_limit_s=args.time_limit,
                                    hint=proof.stage_of)
                    ref = min(ilp.bottleneck_ms, default)

                    def gap(value: float, ref: float = ref) -> str:
                        return f"{(value / ref - 1) * 100:.2f}%"

                    gaps.append(default / ref - 1)
                    auto_gaps.append(auto.refined_ms / ref - 1)
                    worse_than_topo += default > topo.dp_ms + 1e-12
                    if default < auto.refined_ms:
                        changed.append(f"{name} {size} S={stages}: {auto.refined_ms:.6g} -> "
                                       f"{default:.6g} ms "
                                       f"(-{(1 - default / auto.refined_ms) * 100:.2f}%)")
                    bound = default / ilp.lower_bound_ms - 1 if ilp.lower_bound_ms else 0
                    print(f"| {name} | {size} | {problem.num_nodes} | {stages} | {ref:.4f} | "
                          f"{'yes' if ilp.optimal else 'no'} | {gap(topo.dp_ms)} | "
                          f"{gap(cluster.dp_ms)} | {gap(auto.refined_ms)} | {gap(default)} | "
                          f"{proof.by if proof.proven else '-'} | {bound * 100:.2f}% | "
                          f"{topo.seconds:.3f} | {cluster.seconds:.3f} | {auto_s:.3f} | "
                          f"{proof.seconds:.2f} | {ilp.wall_s:.1f} |", flush=True)
    print("\nplans the exact pass changed (auto -> default):")
    print("\n".join(f"- {line}" for line in changed) or "- none")
    print(f"\nauto gap to the ILP's best: median {statistics.median(auto_gaps) * 100:.2f}%, "
          f"worst {max(auto_gaps) * 100:.2f}%")
    print(f"default gap to the ILP's best: median {statistics.median(gaps) * 100:.2f}%, "
          f"worst {max(gaps) * 100:.2f}%; default worse than topo-DP in {worse_than_topo} "
          "cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
