"""How often the bounded hybrid DP finds no plan where the exact DP finds one.

    python tools/hybrid_bounded_misses.py [--seeds 400]

Random training sequences of 3-8 blocks under a memory limit (seed 0 .. ``--seeds``), each
solved by the exact DP and by the bounded one (``EXACT_CELLS`` 0, as on a model too large for the
exact tables, e.g. Llama-3-405B on 16,384 devices). The bounded DP may miss plans by design
(tests/test_hybrid_bounded.py); this counts how often, per variant. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import random

from onnx_partition.errors import PartitionError
from onnx_partition.solve import hybrid_tables
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, solve_hybrid

#: variant -> (recompute, whether the depth is fixed at one block per stage)
VARIANTS = {"recompute auto, depth = blocks": ("auto", True),
            "recompute auto, any depth": ("auto", False),
            "no recompute, depth = blocks": ("none", True)}


def instance(seed: int, recompute: str, fixed: bool) -> tuple[SequenceCosts, HybridConfig]:
    """A random sequence, cluster and memory limit."""
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    forward = [float(rng.randint(1, 6)) for _ in range(n)]
    costs = SequenceCosts(forward, [2.0 * f for f in forward],
                          [float(rng.randint(0, 4)) for _ in range(n)],
                          [float(rng.randint(1, 8)) for _ in range(n)],
                          [0.0] + [float(rng.randint(0, 2)) for _ in range(n - 1)] + [0.0])
    config = HybridConfig(devices=rng.randint(n, 4 * n), memory_bytes=float(rng.randint(10, 40)),
                          microbatches=rng.randint(4, 16), train=True, link_bytes_per_ms=4.0,
                          shard="optimizer", recompute=recompute, max_stages=n,
                          depth=n if fixed else None)
    return costs, config


def plans(costs: SequenceCosts, config: HybridConfig, cells: int) -> bool:
    """Whether the DP with ``EXACT_CELLS`` = ``cells`` finds a plan."""
    saved = hybrid_tables.EXACT_CELLS
    hybrid_tables.EXACT_CELLS = cells
    try:
        solve_hybrid(costs, config)
        return True
    except PartitionError:
        return False
    finally:
        hybrid_tables.EXACT_CELLS = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=400)
    args = parser.parse_args()
    print("| variant | instances the exact DP plans | the bounded DP finds none |")
    print("|---|---|---|")
    for name, (recompute, fixed) in VARIANTS.items():
        feasible = missed = 0
        for seed in range(args.seeds):
            costs, config = instance(seed, recompute, fixed)
            if plans(costs, config, 1 << 24):
                feasible += 1
                missed += not plans(costs, config, 0)
        print(f"| {name} | {feasible} | {missed} ({missed / max(feasible, 1):.0%}) |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
