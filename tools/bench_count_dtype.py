"""The hybrid DP's device counts in int16 against int32, in one run.

    python tools/bench_count_dtype.py [--repeats 3]

The DP's tables (:mod:`onnx_partition.solve.hybrid_tables`, :mod:`~onnx_partition.solve.
hybrid_dp`) held device counts in int16 (so at most 15,999 devices) and now in int32. Each case
is solved with both, alternating, best of ``--repeats``; the answers must agree. Prints a
Markdown table: seconds per dtype and their ratio (int32 / int16).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np

from onnx_partition.solve import hybrid, hybrid_dp, hybrid_exact, hybrid_tables
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, solve_hybrid

#: name -> (positions, devices, micro-batches, memory bytes)
CASES = {
    "exact, memory binds": (60, 32, 16, 60.0),
    "exact, larger": (100, 64, 32, 80.0),
    "bounded, memory binds": (300, 4096, 512, 2000.0),
    "memory free": (400, 4096, 512, float("inf")),
}


def instance(n: int, devices: int, m: int, memory: float) -> tuple[SequenceCosts, HybridConfig]:
    """A random training sequence (seed 0) on ``devices``, recomputation chosen per stage."""
    rng = random.Random(0)
    forward = [float(rng.randint(1, 6)) for _ in range(n)]
    costs = SequenceCosts(forward, [2.0 * f for f in forward],
                          [float(rng.randint(0, 4)) for _ in range(n)],
                          [float(rng.randint(1, 4)) for _ in range(n)],
                          [0.0] + [float(rng.randint(0, 2)) for _ in range(n - 1)] + [0.0])
    return costs, HybridConfig(devices=devices, memory_bytes=memory, microbatches=m,
                               train=True, link_bytes_per_ms=4.0, shard="optimizer",
                               recompute="auto")


def use(dtype: type[np.signedinteger[Any]], no_count: int) -> None:
    """Make the DP hold device counts in ``dtype``, ``no_count`` meaning none."""
    hybrid_tables.COUNT_DTYPE = hybrid_dp.COUNT_DTYPE = hybrid_exact.COUNT_DTYPE = dtype
    hybrid_tables.NO_COUNT = hybrid_dp.NO_COUNT = hybrid_exact.NO_COUNT = no_count
    hybrid.NO_COUNT = no_count
    hybrid_exact._INF = dtype(no_count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kinds: dict[str, tuple[type[np.signedinteger[Any]], int]] = {
        "int16": (np.int16, 16000), "int32": (np.int32, 1 << 20)}
    print("| case | positions, devices, M | int16 s | int32 s | int32 / int16 |")
    print("|---|---|---|---|---|")
    for name, shape in CASES.items():
        costs, config = instance(*shape)
        best: dict[str, float] = {}
        answers: dict[str, object] = {}
        for _ in range(args.repeats):
            for kind, (dtype, no_count) in kinds.items():
                use(dtype, no_count)
                began = time.perf_counter()
                try:
                    solved = solve_hybrid(costs, config)
                    answer: object = (solved.period_ms, [[(s.start, s.end, s.replicas)
                                                          for s in p] for p in solved.plans])
                except hybrid.PartitionError as error:
                    answer = str(error)
                best[kind] = min(best.get(kind, float("inf")), time.perf_counter() - began)
                answers[kind] = answer
        assert answers["int16"] == answers["int32"], name
        print(f"| {name} | {shape[0]}, {shape[1]:,}, {shape[2]} | {best['int16']:.3f} | "
              f"{best['int32']:.3f} | {best['int32'] / best['int16']:.2f} |", flush=True)
    use(*kinds["int32"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
