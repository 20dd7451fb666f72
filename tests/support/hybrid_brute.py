"""Brute force over the hybrid problem on a sequence, written from docs/design.md's formulas
(not the DP's tables): every contiguous split, every replica count ``1..min(D, M)`` per stage
on at most ``D`` devices, every stage within memory under 1F1B (the one memory model)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from onnx_partition.pipeline.memory import StageBytes, memory_per_device
from onnx_partition.solve.hybrid_model import HybridConfig, SequenceCosts


def compositions(total: int, parts: int, most: int) -> Iterator[tuple[int, ...]]:
    """Tuples of ``parts`` counts in ``1..most`` summing to at most ``total``."""
    if parts == 0:
        yield ()
        return
    for r in range(1, min(most, total - (parts - 1)) + 1):
        for rest in compositions(total - r, parts - 1, most):
            yield (r, *rest)


def stage_ms(costs: SequenceCosts, config: HybridConfig, i: int, j: int, r: int) -> float:
    """Stage ``[i, j)`` on ``r`` replicas: ``ceil(M / r) L / M + allreduce / M``."""
    n = len(costs.forward_ms)

    def send(b: int) -> float:
        return 0.0 if b in (0, n) else costs.cut_bytes[b] / config.link_bytes_per_ms + (
            config.link_latency_ms)

    compute = sum(costs.forward_ms[i:j]) + (sum(costs.backward_ms[i:j]) if config.train else 0)
    latency = compute / config.speed + (send(i) + send(j)) * (2 if config.train else 1)
    allreduce = 0.0
    if config.train and r > 1:
        bw = config.group_bytes_per_ms[r] if config.group_bytes_per_ms else (
            config.link_bytes_per_ms)
        lat = config.group_latency_ms[r] if config.group_latency_ms else config.link_latency_ms
        allreduce = 2 * (r - 1) / r * sum(costs.param_bytes[i:j]) / bw + 2 * (r - 1) * lat
    m = config.microbatches
    return latency * math.ceil(m / r) / m + allreduce / m


def plan_memory(costs: SequenceCosts, config: HybridConfig, bounds: list[int],
                reps: tuple[int, ...]) -> list[float]:
    sizes = [StageBytes(sum(costs.param_bytes[i:j]), sum(costs.activation_bytes[i:j]),
                        costs.cut_bytes[i], costs.cut_bytes[j])
             for i, j in itertools.pairwise(bounds)]
    return memory_per_device(sizes, list(reps), config.microbatches,
                             schedule="1f1b" if config.train else "infer",
                             optimizer_factor=config.optimizer_factor)


def brute_hybrid(costs: SequenceCosts, config: HybridConfig
                 ) -> tuple[float, list[tuple[int, int, int]]]:
    """The least bottleneck period and a plan ``(start, end, replicas)`` reaching it (inf,
    [] where none fits); ``config.depth`` fixes the stages."""
    n = len(costs.forward_ms)
    most = min(config.devices, config.microbatches)
    best, plan = math.inf, []
    depths = [config.depth] if config.depth else range(1, min(n, config.devices,
                                                              config.max_stages) + 1)
    for q in depths:
        for inner in itertools.combinations(range(1, n), q - 1):
            bounds = [0, *inner, n]
            spans = list(itertools.pairwise(bounds))
            times = [[stage_ms(costs, config, i, j, r) for r in range(1, most + 1)]
                     for i, j in spans]
            for reps in compositions(config.devices, q, most):
                worst = max(times[k][r - 1] for k, r in enumerate(reps))
                if worst >= best:
                    continue
                if max(plan_memory(costs, config, bounds, reps)) > config.memory_bytes:
                    continue
                best, plan = worst, [(i, j, r) for (i, j), r in zip(spans, reps, strict=True)]
    return best, plan
