"""How a hybrid plan is scored: per-stage costs on the placed cluster, a lower bound, simulation.

One yardstick for the planner's proposals and every baseline of :mod:`.baselines`. An assignment
(node -> stage) and replica counts become :class:`~onnx_partition.pipeline.simulate.PipelineCosts`:
per-stage sums of the node arrays (:func:`stage_totals`), the relay model's bytes across each
boundary, and the link each transfer and all-reduce really crosses once
:meth:`Cluster.place <onnx_partition.cost.cluster.Cluster.place>` has put the replicas on
devices (:func:`totals_costs`). :func:`score` plays the schedule (1F1B for training, forward
streaming for inference) in the event simulator; :func:`lower_bound_ms` bounds any schedule of
those costs from below, so a planner can skip proposals that cannot win.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import numpy as np

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.cost.engine_price import split_ms
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
from onnx_partition.pipeline.schedules import Kind
from onnx_partition.pipeline.simulate import (
    PipelineCosts,
    SimResult,
    StageCosts,
    simulate_schedule,
)
from onnx_partition.settings.partition import TrainSpec
from onnx_partition.solve.problem import DagProblem

if TYPE_CHECKING:
    from onnx_partition.cost.engine_price import EngineTerms
    from onnx_partition.solve.order.blocks import Blocks

__all__ = ["LAST", "HybridPlan", "NodeArrays", "RunSpec", "StageTotals", "assign_devices",
           "lower_bound_ms", "node_arrays", "pipeline_costs", "score", "simulated",
           "stage_totals", "totals_costs"]


#: A holder of a shared initializer (:attr:`NodeArrays.shared`) that is no node: the last
#: stage, whose file holds the graph outputs that are initializers or constants.
LAST = -1


@dataclass(frozen=True)
class NodeArrays:
    """What the hybrid planner needs per node, besides the DAG (plain arrays)."""

    backward_ms: Sequence[float]
    param_bytes: Sequence[float]
    activation_bytes: Sequence[float]  # bytes of the node's outputs, stashed per micro-batch
    names: Sequence[str] = ()  # node keys, for messages
    #: the input-gradient part of backward_ms (zero-bubble schedules); empty: half of it
    backward_input_ms: Sequence[float] = ()
    #: memory only (the one count, docs/design.md "One memory count"): bytes of the
    #: initializers only this node reads (constants and buffers too) and of those the
    #: trainable ones; empty: ``param_bytes``, every one trained (the old per-node count)
    weight_bytes: Sequence[float] = ()
    trainable_bytes: Sequence[float] = ()
    #: initializers several nodes read (a tied parameter): (bytes, trainable bytes, readers),
    #: held by every stage holding one of its readers; a reader :data:`LAST` is the last
    #: stage (a graph output that is an initializer, or a constant made from one)
    shared: Sequence[tuple[float, float, tuple[int, ...]]] = ()
    #: what stage 0 receives per micro-batch: the graph inputs
    input_bytes: float = 0.0
    #: trainable tensors only this node reads (with :attr:`shared`'s trainable ones: each
    #: stage's weight groups of ZB-H1's split backward, cost.engine_price.split_ms); empty: unknown
    trainable_tensors: Sequence[int] = ()
    #: whether a program names what trains, so tied parameters are all-reduced every step
    #: (without one, cost.engine_price.tied_bytes counts none)
    ties_train: bool = False
    #: output-gradient bytes ZB-H1 keeps per micro-batch from I to W (pipeline.memory); empty:
    #: none counted
    kept_bytes: Sequence[float] = ()
    #: the most gradient bytes live in this node's backward (pipeline.memory's ``T``; a stage
    #: holds its nodes' largest); empty: none counted
    working_bytes: Sequence[float] = ()

    @property
    def counted(self) -> bool:
        """Whether the arrays carry the one count (weights and trainable bytes apart)."""
        return len(self.weight_bytes) > 0

    def stage_weights(self, stage_of: Sequence[int] | np.ndarray, num_stages: int
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Weight and trainable bytes of each stage of an assignment: the nodes' own, plus
        each shared initializer once in every stage that reads it (exact, as the stage
        files hold them)."""
        stages_np = np.asarray(stage_of, dtype=np.int64)
        weights: np.ndarray = np.bincount(
            stages_np, np.asarray(self.weight_bytes, dtype=float), minlength=num_stages)
        trained: np.ndarray = np.bincount(
            stages_np, np.asarray(self.trainable_bytes, dtype=float), minlength=num_stages)
        for nbytes, train_bytes, readers in self.shared:
            held = np.unique([num_stages - 1 if v == LAST else int(stages_np[v])
                              for v in readers])
            np.add.at(weights, held, nbytes)
            np.add.at(trained, held, train_bytes)
        return weights, trained

    def stage_engine(self, stage_of: Sequence[int] | np.ndarray, num_stages: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Per stage of an assignment, the trainable bytes of the :attr:`shared` initializers
        another stage holds too (a tied parameter, all-reduced over its holders every step:
        cost.engine_price.tied_bytes) and its trainable tensors (the nodes' own and every shared
        trainable one it holds: partition.trainable_tensors)."""
        stages_np = np.asarray(stage_of, dtype=np.int64)
        tied = np.zeros(num_stages)
        tensors: np.ndarray = np.bincount(
            stages_np, np.asarray(self.trainable_tensors, dtype=float), minlength=num_stages)
        for _, train_bytes, readers in self.shared:
            held = np.unique([num_stages - 1 if v == LAST else int(stages_np[v])
                              for v in readers])
            if train_bytes > 0:
                np.add.at(tensors, held, 1.0)
                if len(held) > 1 and self.ties_train:
                    np.add.at(tied, held, train_bytes)
        return tied, tensors

    def shared_in(self, blocks: Blocks) -> list[tuple[float, float, list[int]]]:
        """:attr:`shared` over the positions of a sequence cut into ``blocks``: each
        initializer with the blocks holding it (:data:`LAST`: the last block, which the last
        stage always holds)."""
        block_of = np.zeros(len(blocks.order), dtype=np.int64)  # node -> its block
        for b, (lo, hi) in enumerate(itertools.pairwise(blocks.bounds)):
            block_of[np.asarray(blocks.order[lo:hi], dtype=np.int64)] = b
        last = len(blocks.bounds) - 2
        return [(b, t, sorted({last if v == LAST else int(block_of[v]) for v in holders}))
                for b, t, holders in self.shared]

    @functools.cached_property
    def columns(self) -> np.ndarray:
        """backward_ms, param_bytes, activation_bytes (and backward_input_ms where given) as
        rows of one float array."""
        rows = [self.backward_ms, self.param_bytes, self.activation_bytes]
        if len(self.backward_input_ms):
            rows.append(self.backward_input_ms)
        return np.asarray(rows, dtype=float).reshape(len(rows), -1)


@dataclass(frozen=True)
class RunSpec:
    """How the plan will run: cluster, mode and micro-batches per iteration."""

    cluster: Cluster
    train: bool = False
    microbatches: int = TrainSpec().microbatches
    optimizer_factor: float = 4.0
    shard: str = TrainSpec().shard  # the replicas' optimizer state (pipeline.memory.SHARD_MODES)
    max_stages: int = 16
    train_schedule: str = "1f1b"  # a planned schedule (schedules.PLANNED_NAMES)
    recompute: str = "none"  # which stages recompute (pipeline.memory.RECOMPUTE_MODES)
    #: the engine's work a train plan is priced with after (cost.engine_price.price_engine): its
    #: step, accumulation and work per action per stage, its extra per hop; None: not priced
    engine: EngineTerms | None = None

    @property
    def schedule(self) -> str:
        """The schedule plans are scored with: ``train_schedule`` in training, ``infer``
        otherwise."""
        return self.train_schedule if self.train else "infer"


@dataclass
class HybridPlan:
    """A scored plan: node -> stage, replicas and devices per stage, simulation result."""

    stage_of: list[int]
    replicas: list[int]
    devices: list[list[str]]
    sim: SimResult
    costs: PipelineCosts
    memory_bytes: list[float]
    source: str  # "dp:<ordering>" or a baseline's name
    planning_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # the planner's lines for the summary

    @property
    def num_stages(self) -> int:
        return len(self.replicas)


def node_arrays(problem: DagProblem, backward_ms: Sequence[float],
                param_bytes: Sequence[float], names: Sequence[str] = (),
                activation_bytes: Sequence[float] | None = None) -> NodeArrays:
    """Per-node activation bytes alongside the given arrays: ``activation_bytes`` when given
    (a train plan's bytes saved for backward, :mod:`onnx_partition.cost.saved`), else the
    bytes of the node's output tensors."""
    if activation_bytes is not None:
        if len(activation_bytes) != problem.num_nodes:
            raise ValueError(f"{len(activation_bytes)} activation sizes for "
                             f"{problem.num_nodes} nodes")
        acts = [float(a) for a in activation_bytes]
    else:
        acts = [0.0] * problem.num_nodes
        for t, prod in enumerate(problem.producer):
            if prod >= 0:
                acts[prod] += problem.nbytes[t]
    return NodeArrays(list(backward_ms), list(param_bytes), acts, list(names))


def assign_devices(cluster: Cluster, replicas: Sequence[int]) -> list[list[str]]:
    """Stage replicas to device ids (:meth:`Cluster.place`): a stage's replicas and
    neighbouring stages on neighbouring devices, so on the same machine where they fit."""
    return [[cluster.device_name(i) for i in stage] for stage in cluster.place(replicas)]


def _links(cluster: Cluster, replicas: Sequence[int], microbatches: int
           ) -> tuple[list[Link], list[Link]]:
    """The link each stage's all-reduce runs over and the link each boundary's transfers take,
    from where :meth:`Cluster.place` puts the replicas: micro-batch ``m`` goes from replica
    ``m % r_k`` to replica ``m % r_(k+1)``; a boundary any of whose transfers leaves its
    machine is charged the inter-machine link."""
    placed = cluster.place(replicas)
    groups = [cluster.group_link(stage) for stage in placed]
    sends = []
    for k, (here, there) in enumerate(itertools.pairwise(placed)):
        if groups[k] is groups[k + 1] is cluster.intra:
            # each stage on one machine: the transfers leave it iff the machines differ
            crosses = cluster.machine_of(here[0]) != cluster.machine_of(there[0])
        else:  # a stage spans machines: follow the micro-batches
            machine = cluster.machine_of
            crosses = any(machine(here[replica_of(m, len(here))])
                          != machine(there[replica_of(m, len(there))])
                          for m in range(microbatches))
        sends.append(cluster.inter if crosses else cluster.intra)
    return groups, sends


@dataclass(frozen=True)
class StageTotals:
    """Per-stage sums of an assignment, which replica counts do not change."""

    forward_ms: np.ndarray
    backward_ms: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    cross_bytes: list[float]  # per interior boundary
    backward_input_ms: np.ndarray | None = None
    #: the one count's weights and trainable bytes per stage (None: ``param_bytes``, trained)
    weight_bytes: np.ndarray | None = None
    trainable_bytes: np.ndarray | None = None
    input_bytes: float = 0.0  # received by stage 0 (the graph inputs)
    #: :meth:`NodeArrays.stage_engine`'s tied bytes and trainable tensors (None: not counted)
    tied_bytes: np.ndarray | None = None
    trainable_tensors: np.ndarray | None = None
    kept_bytes: np.ndarray | None = None  # ZB-H1's from I to W (stage 0 keeps none)
    working_bytes: np.ndarray | None = None  # the backward's working set (None: not counted)


def stage_totals(problem: DagProblem, arrays: NodeArrays, stage_of: Sequence[int],
                 num_stages: int) -> StageTotals:
    stages_np = np.asarray(stage_of, dtype=np.int64)

    def per_stage(values: np.ndarray) -> np.ndarray:
        return np.bincount(stages_np, values, minlength=num_stages)

    # the one array throughout: converting a list of 100k stages costs a millisecond a time
    # (an array of ints reads as the sequence cross_bytes takes: len, indexing, asarray)
    cross = (problem.cross_bytes(cast("Sequence[int]", stages_np), num_stages)
             if num_stages > 1 else [])
    columns = arrays.columns
    weights, trained = (arrays.stage_weights(stages_np, num_stages) if arrays.counted
                        else (None, None))
    tied, tensors = (arrays.stage_engine(stages_np, num_stages) if arrays.counted
                     else (None, None))
    return StageTotals(per_stage(problem.compute_array), per_stage(columns[0]),
                       per_stage(columns[1]), per_stage(columns[2]), cross,
                       per_stage(columns[3]) if len(columns) > 3 else None,
                       weights, trained, arrays.input_bytes, tied,
                       tensors if len(arrays.trainable_tensors) else None,
                       _kept(arrays, stages_np, num_stages),
                       _working(arrays.working_bytes, stages_np, num_stages))


def _working(working: Sequence[float], stages_np: np.ndarray, num_stages: int
             ) -> np.ndarray | None:
    """Per stage, the largest of its nodes' backward working sets (None: not counted)."""
    if not len(working):
        return None
    out = np.zeros(num_stages)
    np.maximum.at(out, stages_np, np.asarray(working, dtype=float))
    return out


def _kept(arrays: NodeArrays, stages_np: np.ndarray, num_stages: int) -> np.ndarray | None:
    """Per stage, the output gradients ZB-H1 keeps from I to W; stage 0, which receives no
    activation, none (None: not counted)."""
    if not len(arrays.kept_bytes):
        return None
    kept: np.ndarray = np.bincount(stages_np, np.asarray(arrays.kept_bytes, dtype=float),
                                   minlength=num_stages)
    kept[0] = 0.0
    return kept


def totals_costs(totals: StageTotals, replicas: Sequence[int], run: RunSpec
                 ) -> tuple[PipelineCosts, list[float]]:
    """Simulator costs of stages with these totals on ``replicas``, and memory per device;
    the stages that recompute are :func:`~onnx_partition.pipeline.memory.recompute_choice`'s
    for ``run.recompute`` (where memory is checked: over the device memory without, within
    it with)."""
    cluster, num_stages = run.cluster, len(replicas)
    groups, links = _links(cluster, replicas, run.microbatches)
    send = [b / link.bytes_per_ms + link.latency_ms
            for b, link in zip(totals.cross_bytes, links)]
    # bytes received at stage k's input boundary (stage 0: the graph inputs)
    cross = [totals.input_bytes, *totals.cross_bytes, 0.0]
    weights, trained = totals.weight_bytes, totals.trainable_bytes
    kept, working = totals.kept_bytes, totals.working_bytes
    sizes = [StageBytes(float(totals.param_bytes[k]) if weights is None else float(weights[k]),
                        float(totals.activation_bytes[k]), cross[k], cross[k + 1],
                        None if trained is None else float(trained[k]),
                        float(kept[k]) if kept is not None and run.train else 0.0,
                        float(working[k]) if working is not None and run.train else 0.0)
             for k in range(num_stages)]
    flags = recompute_choice(sizes, replicas, run.microbatches, schedule=run.schedule,
                             memory_bytes=cluster.memory_bytes, mode=run.recompute,
                             optimizer_factor=run.optimizer_factor, shard=run.shard)
    engine = run.engine if run.train else None
    weighed = [float(x) for x in (totals.param_bytes if weights is None else weights)]
    step = engine.step_ms(weighed) if engine else [0.0] * num_stages
    if engine and totals.tied_bytes is not None:
        step = [t + engine.tied_ms(float(b)) for t, b in zip(step, totals.tied_bytes)]
    accumulate = engine.accumulate_ms(weighed) if engine else [0.0] * num_stages
    split = (split_ms([int(n) for n in totals.trainable_tensors], engine.split_call_ms)
             if engine and run.schedule == "zb-h1" and totals.trainable_tensors is not None
             else [0.0] * num_stages)
    stages = []
    for k, r in enumerate(replicas):
        allreduce = (ring_allreduce_ms(float(totals.param_bytes[k]), r, groups[k].bytes_per_ms,
                                       groups[k].latency_ms) if run.train else 0.0)
        backward = float(totals.backward_ms[k]) / cluster.speed if run.train else 0.0
        grad_in = (float(totals.backward_input_ms[k]) / cluster.speed
                   if run.train and totals.backward_input_ms is not None else None)
        stages.append(StageCosts(
            float(totals.forward_ms[k]) / cluster.speed, backward, r, allreduce,
            stash_bytes(sizes[k]),
            static_bytes(sizes[k], train=run.train, optimizer_factor=run.optimizer_factor,
                         replicas=r, shard=run.shard) + stage_working(sizes[k], run.schedule),
            backward_input_ms=grad_in, recompute=flags[k], input_bytes=sizes[k].received,
            step_ms=step[k], accumulate_ms=accumulate[k], split_ms=split[k],
            action_ms=engine.action_ms if engine else 0.0, kept_bytes=sizes[k].kept))
    memory = memory_per_device(sizes, replicas, run.microbatches, schedule=run.schedule,
                               optimizer_factor=run.optimizer_factor, recompute=flags,
                               shard=run.shard)
    return PipelineCosts(stages, send), memory


def pipeline_costs(
    problem: DagProblem, arrays: NodeArrays, stage_of: Sequence[int], replicas: Sequence[int],
    run: RunSpec,
) -> tuple[PipelineCosts, list[float]]:
    """Simulator costs of an assignment, and each stage's memory per device."""
    return totals_costs(stage_totals(problem, arrays, stage_of, len(replicas)), replicas, run)


def score(
    problem: DagProblem, arrays: NodeArrays, stage_of: Sequence[int], replicas: Sequence[int],
    run: RunSpec, source: str,
) -> HybridPlan:
    """Simulate an assignment: the one yardstick for the DP's plans and every baseline."""
    costs, memory = pipeline_costs(problem, arrays, stage_of, replicas, run)
    return simulated(stage_of, replicas, costs, memory, run, source)


def simulated(stage_of: Sequence[int], replicas: Sequence[int], costs: PipelineCosts,
               memory: list[float], run: RunSpec, source: str) -> HybridPlan:
    """Simulate ``costs`` under the run's schedule, each hop with the engine's work per hop
    where a train run prices it (:attr:`RunSpec.engine`; ``costs`` keep the link's sends, as
    plan.json states them before :func:`~onnx_partition.cost.engine_price.price_engine` adds it).
    By :func:`~onnx_partition.pipeline.simulate.simulate_schedule`: the event simulation's
    figures bit for bit, without its timeline (a plan's Gantt chart re-simulates it)."""
    hop = run.engine.hop_ms if run.train and run.engine else 0.0
    played = replace(costs, send_ms=[s + hop for s in costs.send_ms]) if hop else costs
    sim = simulate_schedule(run.schedule, replicas, run.microbatches, played)
    return HybridPlan(list(stage_of), list(replicas), assign_devices(run.cluster, replicas),
                      sim, costs, memory, source)


def lower_bound_ms(costs: PipelineCosts, microbatches: int, train: bool, *,
                   split: bool = False) -> float:
    """A bound no schedule of these costs beats, so a proposal whose bound is no better than a
    simulated plan need not be simulated (branch and bound). Replica 0 of stage ``k`` starts
    after micro-batch 0 has come forward through stages ``0..k-1``, then computes its
    ``ceil(M / r)`` micro-batches, after which its last one still has to travel on: back to
    stage 0 (training, in parallel with the stage's all-reduce; when the schedule splits the
    backward, ``split``, zero bubble, its deferred weight passes may overlap that way back, so
    only the all-reduce counts) or on to the last stage."""
    stages, send = costs.stages, costs.send_ms
    p = len(stages)
    bound, ahead = 0.0, 0.0  # ahead: when micro-batch 0 can reach stage k at the earliest
    tail_fwd = [0.0] * (p + 1)  # forward from stage k + 1 to the end
    for k in range(p - 1, 0, -1):
        tail_fwd[k - 1] = tail_fwd[k] + send[k - 1] + stages[k].forward_ms
    behind = 0.0  # backward from stage k - 1 to stage 0
    for k, stage in enumerate(stages):
        per_mb = stage.forward_ms + (stage.backward_ms if train else 0.0)
        if train and stage.recompute:
            per_mb += stage.forward_ms
        work = -(-microbatches // stage.replicas) * per_mb
        # split backward: a stage's deferred weight passes may overlap the gradient's way back
        after = (stage.allreduce_ms if split else max(stage.allreduce_ms, behind)) if train \
            else tail_fwd[k]
        bound = max(bound, ahead + work + after)
        if k < p - 1:
            ahead += stage.forward_ms + send[k]
            behind += send[k] + stage.duration(Kind.B)
    return bound
