"""Scoring on a mixed fleet: a candidate's stages placed on fleet devices and simulated.

Each stage runs at its own kind's times (:class:`KindCosts`), each transfer and all-reduce on
the link it crosses once placed (:func:`fleet_costs`), a train plan's engine work on each
stage's own kind; :func:`score_fleet` is the one yardstick of every candidate and baseline
:mod:`.fleet` compares.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from onnx_partition.cost.cluster import Fleet
from onnx_partition.cost.engine_price import EngineTerms, FleetEngine
from onnx_partition.pipeline.layout import replica_of
from onnx_partition.pipeline.memory import (
    StageBytes,
    memory_per_device,
    recompute_choice,
    ring_allreduce_ms,
    stage_working,
    stash_bytes,
    static_bytes,
)
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate_schedule
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec

__all__ = ["FleetPlan", "KindCosts", "fleet_costs", "place_on_groups", "score_fleet"]


@dataclass(frozen=True)
class KindCosts:
    """Per node (the solvers' nodes), one GPU kind's forward and backward times; in training
    also its engine's work (:func:`~onnx_partition.cost.engine_price.engine_terms` on that kind:
    the step, accumulation, work per action and per hop that ``partition`` prices the plan
    with after; None: not priced) and the input-gradient part of each backward (ZB-H1's;
    empty: half)."""

    forward_ms: Sequence[float]
    backward_ms: Sequence[float]
    engine: EngineTerms | None = None
    backward_input_ms: Sequence[float] = ()


@dataclass
class FleetPlan(HybridPlan):
    """A scored fleet plan: a :class:`~.scoring.HybridPlan` whose stage ``k`` runs on GPU kind
    ``gpus[k]`` (``a+b``: replicas on two kinds, only in the "as slowest" baseline's plan)."""

    gpus: list[str] = field(default_factory=list)
    schedule: str = "1f1b"  # the schedule it was scored under (RunSpec.schedule)


def _starts(fleet: Fleet) -> list[int]:
    """The fleet index of each group's first device (devices numbered in file order)."""
    return list(itertools.accumulate((g.devices for g in fleet.groups), initial=0))


def place_on_groups(fleet: Fleet, groups: Sequence[int], replicas: Sequence[int]
                    ) -> list[list[int]]:
    """Fleet device indices (file order) of every stage, stage ``k`` on group ``groups[k]``:
    each group's stages placed in pipeline order by :meth:`Cluster.place`."""
    starts = _starts(fleet)
    placed: list[list[int]] = [[] for _ in replicas]
    for g, cluster in enumerate(fleet.clusters):
        ks = [k for k, h in enumerate(groups) if h == g]
        if ks:
            for k, where in zip(ks, cluster.place([replicas[k] for k in ks])):
                placed[k] = [starts[g] + d for d in where]
    return placed


def fleet_costs(per_kind_fwd: Mapping[str, Sequence[float]],
                per_kind_bwd: Mapping[str, Sequence[float]], sizes: Sequence[StageBytes],
                cross_bytes: Sequence[float], fleet: Fleet, placed: Sequence[Sequence[int]],
                run: RunSpec, allreduce_bytes: Sequence[float] | None = None
                ) -> tuple[PipelineCosts, list[float], list[list[str]], list[str], list[float]]:
    """Simulator costs of stages with these per-kind times and sizes placed on fleet devices
    ``placed`` (file order): a stage runs at its slowest replica's kind (replicas take
    micro-batches in turn); each all-reduce on its group's link when one machine holds the
    stage, else on ``inter``; each transfer (micro-batch ``m`` from replica ``m % r_k`` to
    ``m % r_(k+1)``) on the group's link when it stays on one machine, else on ``inter``.
    Also each stage's memory per device, device ids, GPU kinds (``a+b`` for a stage on two)
    and memory limit in bytes. ``allreduce_bytes``: each stage's gradient bytes all-reduced
    (None: its ``params``)."""
    starts = _starts(fleet)

    def group(d: int) -> int:
        return max(g for g in range(len(fleet.groups)) if starts[g] <= d)

    def machine(d: int) -> int:
        g = group(d)
        return fleet.machine_offset[g] + (d - starts[g]) // fleet.groups[g].devices_per_machine

    stage_groups = [sorted({group(d) for d in where}) for where in placed]
    kinds = [list(dict.fromkeys(fleet.groups[g].gpu for g in gs)) for gs in stage_groups]
    replicas = [len(where) for where in placed]
    send = []
    for k, b in enumerate(cross_bytes):
        here, there = placed[k], placed[k + 1]
        crosses = any(machine(here[replica_of(mb, len(here))])
                      != machine(there[replica_of(mb, len(there))])
                      for mb in range(min(run.microbatches, math.lcm(len(here), len(there)))))
        link = fleet.inter if crosses else fleet.groups[group(here[0])].intra
        send.append(b / link.bytes_per_ms + link.latency_ms)
    limits = [min(fleet.groups[g].memory for g in gs) * 1e9 for gs in stage_groups]
    flags = _recomputed(sizes, replicas, limits, run)
    stages = []
    for k, where in enumerate(placed):
        one = len({machine(d) for d in where}) == 1
        link = fleet.groups[stage_groups[k][0]].intra if one else fleet.inter
        grads = sizes[k].params if allreduce_bytes is None else allreduce_bytes[k]
        allreduce = (ring_allreduce_ms(grads, len(where), link.bytes_per_ms,
                                       link.latency_ms) if run.train else 0.0)
        stages.append(StageCosts(
            max(float(per_kind_fwd[g][k]) for g in kinds[k]),
            max(float(per_kind_bwd[g][k]) for g in kinds[k]) if run.train else 0.0,
            len(where), allreduce, stash_bytes(sizes[k]),
            static_bytes(sizes[k], train=run.train, optimizer_factor=run.optimizer_factor,
                         replicas=len(where), shard=run.shard)
            + stage_working(sizes[k], run.schedule),
            recompute=flags[k], input_bytes=sizes[k].received, kept_bytes=sizes[k].kept))
    memory = memory_per_device(sizes, replicas, run.microbatches, schedule=run.schedule,
                               optimizer_factor=run.optimizer_factor, recompute=flags,
                               shard=run.shard)
    devices = [[fleet.device_name(group(d), d - starts[group(d)]) for d in where]
               for where in placed]
    return PipelineCosts(stages, send), memory, devices, ["+".join(k) for k in kinds], limits


def _recomputed(sizes: Sequence[StageBytes], replicas: Sequence[int],
                limits: Sequence[float], run: RunSpec) -> list[bool]:
    """Which stages recompute under ``run.recompute``
    (:func:`~onnx_partition.pipeline.memory.recompute_choice`), each against its own kind's
    memory ``limits[k]``."""
    chosen = {limit: recompute_choice(sizes, replicas, run.microbatches, schedule=run.schedule,
                                      memory_bytes=limit, mode=run.recompute,
                                      optimizer_factor=run.optimizer_factor,
                                      shard=run.shard)
              for limit in set(limits)}
    return [chosen[limit][k] for k, limit in enumerate(limits)]


def score_fleet(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                fleet: Fleet, run: RunSpec, stage_of: Sequence[int],
                placed: Sequence[Sequence[int]], source: str) -> FleetPlan | None:
    """Simulate an assignment whose stage ``k`` runs on fleet devices ``placed[k]`` (None when
    a stage overflows its devices' memory): the one yardstick of every candidate and
    baseline."""
    s = len(placed)
    at = np.asarray(stage_of, dtype=np.int64)

    def per_stage(values: Sequence[float]) -> np.ndarray:
        return np.bincount(at, np.asarray(values, dtype=float), minlength=s)

    fwd = {gpu: per_stage(c.forward_ms).tolist() for gpu, c in kinds.items()}
    bwd = {gpu: per_stage(c.backward_ms).tolist() for gpu, c in kinds.items()}
    params, acts = per_stage(arrays.columns[1]), per_stage(arrays.columns[2])
    cross = problem.cross_bytes(stage_of, s) if s > 1 else []
    edge = [arrays.input_bytes, *cross, 0.0]  # stage 0 receives the graph inputs
    weights, trained = (arrays.stage_weights(stage_of, s) if arrays.counted
                        else (params, None))  # the one count (NodeArrays.stage_weights)
    kept = (per_stage(arrays.kept_bytes) if run.train and len(arrays.kept_bytes)
            else np.zeros(s))
    kept[0] = 0.0  # stage 0 receives no activation: its whole backward runs in W
    working = np.zeros(s)  # the largest of each stage's nodes' backward working sets
    if run.train and len(arrays.working_bytes):
        np.maximum.at(working, at, np.asarray(arrays.working_bytes, dtype=float))
    sizes = [StageBytes(float(weights[k]), float(acts[k]), edge[k],
                        edge[k + 1] if run.train else 0.0,
                        None if trained is None else float(trained[k]), float(kept[k]),
                        float(working[k]))
             for k in range(s)]
    costs, memory, devices, gpus, limits = fleet_costs(fwd, bwd, sizes, cross, fleet, placed,
                                                       run, [float(p) for p in params])
    if any(mem > limit for mem, limit in zip(memory, limits)):
        return None
    replicas = [len(where) for where in placed]
    played = costs
    if run.train:
        costs, played = _with_engine(costs, kinds, gpus, arrays, stage_of, sizes,
                                     run.schedule, lambda values: per_stage(values).tolist())
    sim = simulate_schedule(run.schedule, replicas, run.microbatches, played)
    return FleetPlan(list(stage_of), replicas, devices, sim, costs, memory, source, gpus=gpus,
                     schedule=run.schedule)


def _with_engine(costs: PipelineCosts, kinds: Mapping[str, KindCosts], gpus: Sequence[str],
                 arrays: NodeArrays, stage_of: Sequence[int], sizes: Sequence[StageBytes],
                 schedule: str, per_stage: Callable[[Sequence[float]], list[float]]
                 ) -> tuple[PipelineCosts, PipelineCosts]:
    """A train plan's costs with each stage's input-gradient time (its kinds' larger, where
    every kind has them) and its engine's work on its own kinds
    (:class:`~onnx_partition.cost.engine_price.FleetEngine`, where every kind has
    :attr:`KindCosts.engine`), and the costs as simulated: each send plus its boundary's work
    per hop (plan.json's sends are the links', as price_engine adds that after)."""
    on = [gpu.split("+") for gpu in gpus]
    stages = list(costs.stages)
    if all(len(kinds[k].backward_input_ms) for ks in on for k in ks):
        grad = {k: per_stage(kinds[k].backward_input_ms) for ks in on for k in ks}
        stages = [replace(c, backward_input_ms=max(grad[k][i] for k in ks))
                  for i, (c, ks) in enumerate(zip(stages, on))]
    terms = [[kinds[k].engine for k in ks] for ks in on]
    if not all(t is not None for ts in terms for t in ts):
        priced = replace(costs, stages=stages)
        return priced, priced
    s = len(stages)
    tied, tensors = (arrays.stage_engine(stage_of, s) if arrays.counted  # as totals_costs
                     else (None, None))
    work = FleetEngine.of(terms, [size.params for size in sizes],  # type: ignore[arg-type]
                          tied=None if tied is None else tied.tolist(),
                          tensors=None if tensors is None or not len(arrays.trainable_tensors)
                          else [int(n) for n in tensors], split=schedule == "zb-h1")
    stages = [replace(c, step_ms=work.step_ms[i], accumulate_ms=work.accumulate_ms[i],
                      split_ms=work.split_ms[i], action_ms=work.action_ms[i])
              for i, c in enumerate(stages)]
    priced = replace(costs, stages=stages)
    return priced, replace(priced, send_ms=[x + h for x, h in zip(costs.send_ms,
                                                                  work.hop_ms)])
