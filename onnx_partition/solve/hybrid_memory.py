"""Memory per device as the hybrid DP counts it: a plan's stages' bytes (:func:`stage_memory`,
the DP's ``static + held * stash`` tables) and, when no plan fits, the report of which stages of
the least-memory plan are over the limit and by how much (:func:`memory_report`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from onnx_partition.pipeline.memory import kept_held, peak_inflight
from onnx_partition.solve.hybrid_exact import exact_fewest
from onnx_partition.solve.hybrid_model import HybridConfig, HybridStage, SequenceCosts
from onnx_partition.solve.hybrid_tables import StageTables, held_caps
from onnx_partition.values import fmt_bytes

__all__ = ["memory_report", "stage_memory"]


def stage_memory(costs: SequenceCosts, config: HybridConfig,
                 stages: Sequence[tuple[int, int, int]],
                 recompute: Sequence[bool] = ()) -> list[float]:
    """Bytes per device of a plan's stages ``(start, end, replicas)`` as the DP checks them:
    its ``base + held * stash + kept * per_kept`` tables at ``[start, end)``
    (:meth:`~.hybrid_tables.StageTables.kept_tables`; the recomputing ones where
    ``recompute`` flags a stage, else as ``config.recompute`` says), ``held`` and ``kept``
    those of ``config.train_schedule`` (1F1B: none kept; one held in inference), each replica's
    shard of the optimizer state; the tests hold them to the stage files' count and to
    :func:`~onnx_partition.pipeline.memory.memory_per_device`."""
    tables = StageTables(costs, config)
    replicas = [r for _, _, r in stages]
    held = peak_inflight(tables.schedule, replicas, config.microbatches)
    kept = kept_held(tables.schedule, replicas, config.microbatches)
    flags = list(recompute) or [tables.mode == "all"] * len(stages)
    ways = [tables.kept_tables(False), tables.kept_tables(True)]
    return [float(ways[f][0][i, j] - tables.shed(r) + h * ways[f][1][i, j]
                  + g * ways[f][2][i, j])
            for (i, j, r), h, g, f in zip(stages, held, kept, flags, strict=True)]


_NAMED = 3  # stages the memory error names (the fullest)


def memory_report(tables: StageTables, config: HybridConfig, max_q: int,
                   costs: SequenceCosts) -> str:
    """Why nothing fits: the plan whose fullest device needs the least memory (the exact DP
    at every period, bisected on the memory per device), and each of its stages over the
    limit: index, first and last operator, bytes over (each stage recomputing where that is
    chosen per stage, ``auto``, and keeping does not fit)."""
    depths = [config.depth] if config.depth else list(range(1, max_q + 1))
    auto = tables.period_rc is not None
    periods = tables.period_rc if tables.period_rc is not None else tables.period
    top = float(np.nanmax(np.where(np.isfinite(periods), periods, np.nan)))
    # every figure a stage could need: base + held * stash + kept * per_kept for held 1..M
    # and kept 0 (1F1B) or 1..held (ZB-H1); no plan on D devices holds more than 2 D + 1 (its
    # first warm-up is at most 2 D: design.md), which keeps this grid small (8 H100 at M =
    # 512 under ZB-H1: 153 pairs, not 131,328, each table of 2,556 stages x pairs 2.7 GB)
    most = min(config.microbatches, 2 * config.devices + 1) if config.train else 1
    pairs = [(h, g) for h in range(1, most + 1)
             for g in (range(1, h + 1) if tables.zb else [0])]
    held = np.asarray([h for h, _ in pairs], dtype=float)[None, :]
    kept = np.asarray([g for _, g in pairs], dtype=float)[None, :]
    valid = np.isfinite(tables.latency)
    ways = [tables.kept_tables(tables.mode == "all")] + [tables.kept_tables(True)] * auto
    needs = np.unique(np.concatenate([
        (base[valid][:, None] + held * stash[valid][:, None]
         + kept * per_kept[valid][:, None]).ravel() for base, stash, per_kept in ways]))
    needs = needs[needs > config.memory_bytes]

    def plan_within(memory: float) -> list[HybridStage] | None:
        exact = exact_fewest(tables, top, max_q, held_caps(tables, memory),
                              held_caps(tables, memory, rebuilt=True) if auto else None,
                              memory)
        fit = [(exact.fewest(q), q) for q in depths if exact.fewest(q) <= config.devices]
        return exact.stages(tables, min(fit)[1]) if fit else None

    lo, hi = -1, len(needs) - 1
    best = plan_within(float(needs[hi])) if needs.size else None
    if best is None:  # not even with every stage's largest need: too few devices
        return (f"no plan fits on {config.devices} devices: every split needs more stages "
                f"than devices")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = plan_within(float(needs[mid]))
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    stages = tables.with_memory(best)
    over = [(k, s) for k, s in enumerate(stages) if s.memory_bytes > config.memory_bytes]
    more = len(over) - _NAMED
    over = sorted(sorted(over, key=lambda e: -e[1].memory_bytes)[:_NAMED], key=lambda e: e[0])
    parts = "; ".join(
        f"stage {k} ({_span_name(costs, s.start, s.end)}) needs {fmt_bytes(s.memory_bytes)}"
        f"{' recomputing' * s.recompute}, "
        f"{fmt_bytes(math.ceil(s.memory_bytes - config.memory_bytes))} over" for k, s in over)
    return (
        f"no plan fits in {fmt_bytes(config.memory_bytes)} per device on {config.devices} "
        f"devices: the plan needing the least ({len(stages)} stage{'s' * (len(stages) > 1)}, "
        f"replicas "
        f"{[s.replicas for s in stages]}) is over it in {parts}"
        + (f"; and {more} more stage{'s' * (more > 1)}" if more > 0 else "")
    )


def _span_name(costs: SequenceCosts, lo: int, hi: int) -> str:
    """Positions ``[lo, hi)`` by their first and last operator (``labels``, and
    ``last_labels`` where a position is a block), else by index."""
    if not costs.labels:
        return f"position {lo}" if hi == lo + 1 else f"positions {lo}..{hi - 1}"
    first = costs.labels[lo]
    last = (costs.last_labels or costs.labels)[hi - 1]
    return first if first == last else f"{first} to {last}"
