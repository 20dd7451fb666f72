"""What the default exact pass proves of hybrid plans: the hybrid DP's period against CP-SAT.

    python tools/bench_hybrid_proof.py [--recipes gpt resnet] [--sizes tiny] [--devices 2 4 8]
                                       [--modes infer train] [--budget 1] [--any-size]

For each recipe, size, device count and mode: the planner's plan (:func:`plan_cluster`, 16
micro-batches, the PCIe setting of ``tools/bench_planner.py``: 24 GB devices), then
:func:`~onnx_partition.solve.hybrid_proof.prove_hybrid` on it (``--budget`` deterministic
seconds of CP-SAT on one worker): the sequence it judged (ordering, blocks), whether the DP's
least bottleneck period is proven, its gap to CP-SAT's bound otherwise, the chosen plan's own
period in that model, and the pass's wall time. ``--any-size`` lifts the size threshold
(:data:`~onnx_partition.solve.hybrid_proof.PROOF_CELLS` stage choices and
:data:`~onnx_partition.solve.hybrid_proof.PROOF_DEVICES` devices) to show where it stops
paying; ``--memory-gb`` makes memory bind. Analytic H100 costs, batch 8. Prints a Markdown
table and a summary.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from bench_planner import MICROBATCHES, SETTINGS, cluster_for, recipe_problem

from onnx_partition.errors import PartitionError
from onnx_partition.solve.hybrid_proof import PROOF_CELLS, PROOF_DEVICES, prove_hybrid
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.scoring import RunSpec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=["gpt", "resnet", "inception", "unet"])
    parser.add_argument("--sizes", nargs="*", default=["tiny"])
    parser.add_argument("--devices", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--modes", nargs="*", default=["infer", "train"])
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--any-size", action="store_true")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="device memory (default: the setting's 24 GB), to make it bind")
    args = parser.parse_args()
    setting = SETTINGS["pcie"]
    if args.memory_gb is not None:
        setting = replace(setting, memory_gb=args.memory_gb)
    limits = (10**9, 10**9) if args.any_size else (PROOF_CELLS, PROOF_DEVICES)
    print("| recipe | size | units | D | mode | plan | ordering | blocks | proof | gap | "
          "DP period ms | plan period ms | s |")
    print("| --- " * 13 + "|")
    proven = tried = 0
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for name in args.recipes:
                problem, arrays = recipe_problem(name, size, Path(tmp), setting)
                for devices in args.devices:
                    for mode in args.modes:
                        run = RunSpec(cluster_for(devices, setting), train=mode == "train",
                                      microbatches=MICROBATCHES)
                        try:
                            plan, _ = plan_cluster(problem, arrays, run)
                        except PartitionError as error:
                            print(f"| {name} | {size} | {problem.num_nodes} | {devices} | "
                                  f"{mode} | {error} |" + " |" * 7)
                            continue
                        proof = prove_hybrid(problem, arrays, run, plan, budget_s=args.budget,
                                             max_cells=limits[0], max_devices=limits[1])
                        attempted = proof.by in ("bound", "cp-sat", "budget", "disagree")
                        tried += attempted
                        proven += proof.proven
                        if proof.gap is not None:
                            worst = max(worst, proof.gap)
                        shape = "x".join(map(str, plan.replicas))
                        plan_ms = ("" if proof.plan_period_ms is None
                                   else f"{proof.plan_period_ms:.6g}")
                        print(f"| {name} | {size} | {problem.num_nodes} | {devices} | {mode} | "
                              f"{shape} | {proof.ordering} | {proof.positions} | {proof.by} | "
                              f"{'' if proof.gap is None else f'{proof.gap * 100:.2f}%'} | "
                              f"{'' if proof.period_ms is None else f'{proof.period_ms:.6g}'} | "
                              f"{plan_ms} | {proof.seconds:.2f} |", flush=True)
    print(f"\njudged {tried} plans: proved {proven}, worst gap {worst * 100:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
