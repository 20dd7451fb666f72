"""Brute force over the fleet DP's problem: every split, group assignment along an ordering
(each group one run of stages, or none) and every replica count ``1..min(D_g, M)`` per stage,
priced by :func:`~onnx_partition.solve.fleet_dp.stage_period` (the DP's scalar statement)."""

from __future__ import annotations

import itertools
import math
import random

from onnx_partition.cost.cluster import Fleet, GpuGroup, Link
from onnx_partition.solve.fleet_dp import FleetSequence, stage_period
from onnx_partition.solve.scoring import RunSpec


def brute_fleet(seq: FleetSequence, fleet: Fleet, run: RunSpec,
                ordering: tuple[int, ...]) -> float:
    """The least bottleneck period, by enumeration (inf: nothing fits)."""
    n, best = seq.n, math.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
        spans = list(itertools.pairwise(bounds))
        for pos in itertools.product(range(len(ordering)), repeat=len(spans)):
            if any(a > b for a, b in itertools.pairwise(pos)):
                continue
            groups = [ordering[p] for p in pos]
            most = max(run.microbatches, 1)
            options = [range(1, min(fleet.groups[g].devices, most) + 1) for g in groups]
            for reps in itertools.product(*options):
                used = {g: sum(r for r, h in zip(reps, groups, strict=True) if h == g)
                        for g in groups}
                if any(used[g] > fleet.groups[g].devices for g in used):
                    continue
                worst = 0.0
                for k, ((i, j), g, r) in enumerate(zip(spans, groups, reps, strict=True)):
                    enter = None if k == 0 else (
                        fleet.groups[g].intra if pos[k - 1] == pos[k] else fleet.inter)
                    leave = None if k == len(spans) - 1 else (
                        fleet.groups[g].intra if pos[k + 1] == pos[k] else fleet.inter)
                    worst = max(worst, stage_period(seq, fleet, run, g, i, j, r, enter, leave))
                best = min(best, worst)
    return best


def two_groups(rng: random.Random) -> Fleet:
    """A random fleet of one A100 and one V100 machine, 1-3 devices each."""
    return Fleet(groups=(
        GpuGroup("a100-80gb", 1, rng.randint(1, 3), rng.uniform(1.2e-5, 3e-5), Link(5.0, 0.01)),
        GpuGroup("v100", 1, rng.randint(1, 3), rng.uniform(1.2e-5, 3e-5), Link(2.0, 0.01))),
        inter=Link(1.0, 0.02))
