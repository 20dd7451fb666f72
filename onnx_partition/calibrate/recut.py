"""``profile --plan``: calibrate a written plan on its own stages, and re-cut when that moves
the optimum.

A plan is priced on per-node costs (a profile, or the analytic model); the pipeline runs each
stage as one session beside the others, which the per-node sum does not see (``run`` measured
0.59-0.87x of ``simulate`` on CPU at 2 stages). Calibration closes that loop:

1. **Measure** (:func:`onnx_partition.cost.profile.stages.time_stages`): every stage's file in
   onnxruntime on its devices, with the plan's threads per stage, at its micro-batch shape (its
   inputs from one pass of random model inputs through the stages), alone and all stage
   replicas side by side in threads as ``run`` runs them; then the plan itself in ``run``'s
   pipeline (:func:`pipeline_times`): each stage's busy time per micro-batch there is its
   time, plus what the runtime adds per micro-batch and stage beyond compute and the modelled
   sends (:func:`hop_overhead`: thread hand-offs, copies; it is most of a stage of 1 ms).
2. **Re-price** (:func:`~onnx_partition.cost.profile.stages.reprice`): the nodes of each stage
   scaled so the stage costs its measured time.
3. **Re-solve** with those costs (the plan's own options: stages, mode, micro-batches, solver,
   link, cluster, input shapes). The same stages, or other stages predicted less than
   :data:`MIN_GAIN` faster than the measured ones: the plan is at the calibrated optimum, stop.
   Other stages: they are written aside, measured in turn (back to 1), at most ``rounds`` times.

The plan written is the measured one with the smallest measured bottleneck (on a tie, the
later); its stages' ``predicted.compute_ms`` are their measured times (inference: busy in the
pipeline plus the hop overhead; training: forward + backward side by side) and its totals
follow from them. plan.json says so in ``calibrated``: each round's stages and times, the threads,
repeats and warmup, and whether the optimum held. The folder is published atomically
(:func:`onnx_partition.plan.folder.publish`), in place or to ``out``.

A train plan's stages are torch modules: :mod:`onnx_partition.calibrate.stage_modules` times each
one's forward and backward (alone, and side by side in one process per stage as the ranks run),
and forward and backward are re-priced apart. The rounds choose the cut on those times; the plan
written is then run in the engine itself (:func:`~onnx_partition.calibrate.stage_modules.
measure_train_run`, a few steps of ``train``), which prices it (:func:`_run_calibrated`): its
stages' compute per micro-batch there, the engine's work per action (``simulator_costs.
action_ms``), each stage's tail and barriers (``step_ms``) and the hops (``send_ms``: the idle
ping-pong plus the extra fitted to the run's step); ``calibrated.engine_run`` records it. The
run's measured memory calibrates the memory model's parts (:mod:`onnx_partition.calibrate.
memory`; ``calibrated.engine_run.memory``).
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_partition.calibrate.memory import memory_calibrated
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import CostsFile, annotate, load_costs
from onnx_partition.cost.cluster import Cluster
from onnx_partition.cost.costs_file import check_costs, provenance, rescale
from onnx_partition.cost.profile.stages import StageTimes, reprice, time_stages
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load
from onnx_partition.partition import AUTO, SOLVERS, partition, priced_as_run
from onnx_partition.pipeline.schedules import PLANNED_NAMES
from onnx_partition.plan import MANIFEST, Plan, read_plan
from onnx_partition.plan.contracts import FleetFields
from onnx_partition.plan.extras import AnalyticDevice, Calibrated, CostsDevice, EngineCosts
from onnx_partition.plan.folder import publish
from onnx_partition.plan.schema import parse

if TYPE_CHECKING:
    from onnx_partition.runtime.train.overheads import RunCosts

__all__ = ["MIN_GAIN", "Calibration", "calibrate_plan", "hop_overhead", "measure_plan",
           "pipeline_times", "stage_keys"]

#: A re-cut is taken only when its calibrated prediction beats the measured plan's by more than
#: this fraction: smaller moves are within what timing on a shared machine varies by.
MIN_GAIN = 0.02


@dataclass
class Calibration:
    """What :func:`calibrate_plan` did: the plan written, and per round the stages measured
    (their node counts), their priced and measured ms, and whether re-solving moved the cut."""

    plan: Plan
    out: Path
    rounds: list[dict[str, Any]] = field(default_factory=list)
    converged: bool = False
    chosen: int = 0  # the round whose stages were written


def stage_keys(plan: Plan) -> list[list[str]]:
    """Node keys of each stage (the cut)."""
    return [list(s.nodes) for s in plan.stages]


def _feeds_per_stage(plan: Plan, stages: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Each stage's inputs at the plan's micro-batch: random model inputs run through the
    stages once, in order (replica 0)."""
    from onnx_partition.runtime.infer.check import random_feeds

    env: dict[str, Any] = dict(random_feeds(plan, batch_size=plan.rows_per_microbatch))
    feeds = []
    for replicas in stages:
        first = replicas[0]
        feed = {name: env[name] for name in first.inputs}
        feeds.append(feed)
        env.update(zip(first.outputs, first.session.run(first.outputs, feed), strict=True))
    return feeds


def measure_plan(folder: str | os.PathLike[str], *, threads_per_stage: int = 1,
                 repeats: int = 10, warmup: int = 2) -> StageTimes:
    """Each stage replica of the inference plan in ``folder`` timed alone and side by side
    (its session on its device, ``threads_per_stage`` intra-op threads, as ``run``); per stage
    the mean over its replicas."""
    from onnx_partition.runtime.infer.sessions import load_stages

    plan, stages = load_stages(folder, threads_per_stage=threads_per_stage)
    feeds = _feeds_per_stage(plan, stages)
    runs, owner = [], []
    for k, replicas in enumerate(stages):
        for replica in replicas:
            runs.append(lambda r=replica, f=feeds[k]: r.session.run(r.outputs, f))
            owner.append(k)
    timed = time_stages(runs, repeats=repeats, warmup=warmup)

    def per_stage(values: Sequence[float]) -> list[float]:
        out = []
        for k in range(len(stages)):
            mine = [v for v, o in zip(values, owner, strict=True) if o == k]
            out.append(sum(mine) / len(mine))
        return out

    return StageTimes(per_stage(timed.alone_ms), per_stage(timed.together_ms), repeats, warmup)


def pipeline_times(folder: str | os.PathLike[str], *, threads_per_stage: int = 1,
                   iterations: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """The inference plan in ``folder`` run as ``run`` runs it (a
    :class:`~onnx_partition.runtime.infer.pipeline.PipelineSession`, its micro-batches): the
    median iteration ms and each stage's busy ms per micro-batch (mean over its replicas)."""
    from statistics import median

    from onnx_partition.runtime.infer.check import random_feeds
    from onnx_partition.runtime.infer.pipeline import PipelineSession

    plan = read_plan(folder)
    rows = plan.rows_per_microbatch
    feeds = random_feeds(plan, batch_size=rows * plan.microbatches if rows else None)
    walls: list[float] = []
    busy: dict[tuple[int, int], float] = {}
    with PipelineSession(folder, threads_per_stage=threads_per_stage) as session:
        for i in range(warmup + iterations):
            session.run(None, feeds)
            if i < warmup:
                continue
            stats = session.last_stats
            walls.append(stats.wall_ms)
            for key, ms in stats.busy_ms.items():
                busy[key] = busy.get(key, 0.0) + ms / iterations / max(stats.microbatches, 1)
    per_stage = []
    for k in range(len(plan.stages)):
        mine = [v for (stage, _), v in busy.items() if stage == k]
        per_stage.append(sum(mine) / len(mine) if mine else 0.0)
    return median(walls), per_stage


def hop_overhead(plan: Plan, compute_ms: Sequence[float], wall_ms: float) -> float:
    """What the runtime adds per stage and micro-batch beyond compute and the modelled sends
    (thread hand-offs, copies): the measured iteration less the one simulated with
    ``compute_ms``, over the ``ceil(M / r) + S - 1`` steps of a pipeline's critical path (``r``
    the fewest replicas of a stage); at least 0."""
    from onnx_partition.pipeline.from_plan import simulate_plan

    trial = copy.deepcopy(plan)
    for stage, ms in zip(trial.stages, compute_ms, strict=True):
        if stage.predicted is not None:
            stage.predicted.compute_ms = ms
    result, _ = simulate_plan(trial)
    replicas = min(max(1, s.replicas) for s in trial.stages)
    steps = -(-trial.microbatches // replicas) + len(trial.stages) - 1
    return max(0.0, (wall_ms - result.iteration_ms) / steps)


def _base_costs(plan: Plan, graph: OpGraph) -> tuple[dict[str, float], dict[str, float]]:
    """Forward and backward ms per compute node key as the plan was priced: its costs file
    when it is still there, else the analytic device it records."""
    model = plan.device_model
    costs = None
    if isinstance(model, CostsDevice) and model.file and Path(model.file).is_file():
        costs = load_costs(model.file)
    if costs is not None:
        node_costs = annotate(graph, costs=costs)
        node_costs = rescale(node_costs, graph, list(costs.nodes), check_costs(costs,
                                                                               graph).scale)
        shared = plan.compute_scale  # as partition priced it beside the others
        if shared is not None:
            node_costs = rescale(node_costs, graph, list(costs.nodes),
                                 float(shared.forward), backward=float(shared.backward))
    else:
        device = DeviceSpec.cpu()
        if isinstance(model, AnalyticDevice) and model.peak_tflops:
            device = DeviceSpec(model.name, peak_gflops=float(model.peak_tflops) * 1e3,
                                mem_gbps=float(model.mem_gbps),
                                launch_overhead_ms=float(model.launch_overhead_ms))
        node_costs = annotate(graph, device=device)
    keys = {g: graph.nodes[g].key for g in graph.compute_nodes}
    return ({k: node_costs.forward_ms[g] for g, k in keys.items()},
            {k: node_costs.backward_ms[g] for g, k in keys.items()})


def _costs_file(graph: OpGraph, forward: dict[str, float], backward: dict[str, float] | None,
                device: str) -> CostsFile:
    nodes = {k: {"forward_ms": v} | ({"backward_ms": backward[k]} if backward else {})
             for k, v in forward.items()}
    body = {"source": "profile --plan", **provenance(graph, device), "nodes": nodes,
            **({"mode": "train"} if backward else {})}
    return CostsFile("profile --plan", body, nodes)


def _cluster_of(plan: Plan) -> Cluster | None:
    if isinstance(plan.cluster, FleetFields):
        raise PartitionError("profile --plan re-cuts plans of one kind of device, not a mixed "
                             "fleet's (cluster@2 groups)")
    return Cluster.of(plan.cluster) if plan.cluster is not None else None


def _resolve(model: Path, plan: Plan, graph: OpGraph, costs: CostsFile, out: Path) -> Plan:
    """``plan`` cut again on ``costs``: the same depth, cluster, micro-batches and, in
    training, the schedule it was planned for, its precision and its ``--recompute`` (plan.json
    ``schedule``, ``precision``, ``recompute``; ``auto`` where it records none)."""
    cluster = _cluster_of(plan)
    train = plan.mode == "train"
    schedule = plan.schedule
    return partition(
        model, len(plan.stages), out, costs=costs, input_shapes=plan.input_shapes,
        mode=plan.mode, microbatches=plan.microbatches, ordering="auto",
        solver=plan.solver if plan.solver in SOLVERS and cluster is None else "dp",
        link=plan.link if cluster is None else None,
        cluster=cluster, force=True, check=False,
        schedule=schedule if train and schedule in PLANNED_NAMES else AUTO,
        recompute=(plan.recompute or AUTO) if train else AUTO,
        precision=(plan.precision or "fp32") if train else "fp32")


def _score(plan: Plan) -> float:
    """What the solver minimised, as plan.json predicts it: the bottleneck of a pipeline, the
    iteration of a hybrid plan."""
    predicted = plan.predicted
    if predicted.bottleneck_ms is not None:
        return float(predicted.bottleneck_ms)
    return float(predicted.iteration_ms) if predicted.iteration_ms is not None else 0.0


def _bottleneck(plan: Plan, together: Sequence[float]) -> float:
    return max(t + (s.predicted.comm_ms if s.predicted else 0.0)
               for t, s in zip(together, plan.stages, strict=True))


def _calibrated(plan: Plan, forward: Sequence[float], backward: Sequence[float]) -> None:
    """``plan`` priced with its measured stage times (compute_ms, forward_ms and backward_ms in
    training, and the totals from them)."""
    together = [f + b for f, b in zip(forward, backward, strict=True)]
    train = plan.mode == "train"
    for stage, f, b in zip(plan.stages, forward, backward, strict=True):
        if stage.predicted is not None:
            # the sum of the parts as stored (each rounded), so compute = forward + backward
            stage.predicted.compute_ms = round(round(f, 6) + round(b, 6), 6)
            if train:
                stage.predicted.forward_ms, stage.predicted.backward_ms = round(f, 6), round(b, 6)
    if train and not plan.simulator_costs.empty():
        plan.simulator_costs.forward_ms = [round(f, 6) for f in forward]
        plan.simulator_costs.backward_ms = [round(b, 6) for b in backward]
    if plan.predicted.bottleneck_ms is not None:
        plan.predicted.bottleneck_ms = round(_bottleneck(plan, together), 6)
    priced_as_run(plan)  # iteration, throughput and bubble: the plan's own simulation


def _engine_calibrated(plan: Plan, engine: Mapping[str, Any]) -> None:
    """``plan`` priced with the engine's measured work (:func:`~onnx_partition.
    calibrate.stage_modules.measure_train_engine`): ``simulator_costs.step_ms``, ``accumulate_ms``,
    ``send_ms`` and ``hop_bytes``, ``engine_costs`` saying so, and the totals simulated again;
    ``action_ms``, the engine's work around each action, is kept as priced."""
    sim = plan.simulator_costs
    sim.step_ms = [round(t, 6) for t in engine["step_ms"]]
    sim.accumulate_ms = [round(t, 6) for t in engine["accumulate_ms"]]
    sim.send_ms = [round(t, 6) for t in engine["send_ms"]]
    sim.hop_bytes = [float(b) for b in engine["hop_bytes"]]
    sim.split_ms = None  # the stages' I and W were timed as the engine runs them
    plan.simulator_costs = sim
    # the engine's work around each action was not timed here: partition's action_ms stays
    said = EngineCosts(
        step_ms=f"calibrated: {engine['optimizer']} step on each stage module's parameters "
                f"(profile --plan) + 2 two-process barriers of {engine['barrier_ms']:.4g} ms"
                " + a hop of the parameters tied across stages (their all-reduce)",
        accumulate_ms="calibrated: in-place gradient adds over each stage module's "
                      "parameters (profile --plan)")
    said.send_ms = ("calibrated: each hop's bytes there and back between two processes over "
                    "gloo (profile --plan), one way")
    said.action_ms = plan.engine_costs.action_ms
    plan.engine_costs = said
    priced_as_run(plan)


def _run_calibrated(plan: Plan, run: RunCosts, schedule: str, microbatches: int,
                    sends: Sequence[float], input_share: Sequence[float] | None) -> dict[str, Any]:
    """``plan`` priced by its own run in the engine (:func:`~onnx_partition.calibrate.stage_modules.
    measure_train_run`): its stages' forward and backward per micro-batch there (the backward
    less the gradients' accumulation, which the simulator adds back; under ZB-H1 split in
    ``input_share``, the side-by-side timing's ``I`` share), ``simulator_costs.action_ms`` and
    ``step_ms`` (tail and barriers) from the run, ``send_ms`` the idle hops (``sends``) plus
    the extra per hop that makes the run's simulation last its measured step
    (:func:`~onnx_partition.runtime.train.overheads.fit_hop_ms`). Returns what ``calibrated``
    records of the run."""
    from onnx_partition.pipeline import schedules
    from onnx_partition.runtime.train.overheads import fit_hop_ms, run_pipeline

    sim = plan.simulator_costs
    plan.simulator_costs = sim
    if input_share is not None:
        run = replace(run, backward_input_ms=[b * s for b, s in
                                              zip(run.backward_ms, input_share, strict=True)])
    grid = schedules.build(schedule, run.replicas, microbatches)
    hop = fit_hop_ms(grid, run_pipeline(run, sends), run.measured_ms)
    accumulate = [float(a) for a in sim.accumulate_ms or [0.0] * len(run.replicas)]
    adds = [max(microbatches - r, 0) / microbatches for r in run.replicas]
    backward = [max(b - a * n, 0.0) for b, a, n in zip(run.backward_ms, accumulate, adds,
                                                       strict=True)]
    _calibrated(plan, run.forward_ms, backward)
    if input_share is not None:
        sim.backward_input_ms = [round(b * s, 6) for b, s in
                                 zip(backward, input_share, strict=True)]
    sim.action_ms = [round(a, 6) for a in run.action_ms]
    sim.step_ms = [round(t, 6) for t in run.step_ms()]
    sim.send_ms = [round(s + hop, 6) for s in sends]
    said = plan.engine_costs
    said.step_ms = ("calibrated: the plan run in the engine (profile --plan): each stage's "
                    "optimizer step, gradient sums and sends awaited, + 2 barriers of "
                    f"{run.barrier_ms:.4g} ms")
    said.action_ms = ("calibrated: the engine's work per action outside compute and receives, "
                      "the plan run in the engine (profile --plan)")
    said.send_ms = ("calibrated: each hop's bytes there and back between two idle processes "
                    f"over gloo, one way, + {hop:.4g} ms per hop fitted so the run's "
                    "simulation lasts its measured step (profile --plan)")
    plan.engine_costs = said
    priced_as_run(plan)
    return {"by": "train (the engine), synthetic batches", "schedule": schedule,
            "microbatches": microbatches, "measured_ms": round(run.measured_ms, 6),
            "forward_ms": [round(f, 6) for f in run.forward_ms],
            "backward_ms": [round(b, 6) for b in run.backward_ms],
            "action_ms": sim.action_ms, "barrier_ms": round(run.barrier_ms, 6),
            "idle_send_ms": [round(s, 6) for s in sends], "hop_ms": round(hop, 6),
            "measured_where": {
                "forward_ms, backward_ms, action_ms, step_ms, hop_ms": "the plan run in the "
                "engine", "backward_input_ms": "the I share of the stages timed side by side",
                "accumulate_ms": "the stage modules' gradients added in place",
                "send_ms": "an idle two-process ping-pong at each hop's bytes + hop_ms"}}


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _publish(source: Path, plan: Plan, out: Path) -> None:
    """The plan folder ``source`` with ``plan`` as its plan.json, published as ``out``."""
    model = (source / plan.model).resolve() if plan.model else None
    program = (source / plan.program).resolve() if plan.program else None

    def write(tmp: Path) -> dict[str, Any]:
        for path in sorted(source.rglob("*")):
            name = path.relative_to(source)
            if path.is_file() and name.as_posix() in (plan.manifest or {}):
                _link_or_copy(path, tmp / name)
        here = Path(os.path.abspath(out)).resolve()
        if model is not None:
            plan.model = os.path.relpath(model, here)
        if program is not None:
            plan.program = os.path.relpath(program, here)
        body = plan.to_json()
        body.pop(MANIFEST, None)  # publish writes the new one
        return body

    protect = [model] if model is not None else []
    plan.manifest = publish(out, write, force=True, protect=protect)


def _executor(train: bool) -> str:
    if train:
        from onnx_partition.cost.profile.torch_ops import executor

        return executor()
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__}"


def calibrate_plan(
    folder: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    rounds: int = 3,
    threads_per_stage: int = 1,
    repeats: int = 10,
    warmup: int = 2,
) -> Calibration:
    """Calibrate the plan in ``folder`` (module docstring; a train plan's stage modules:
    :mod:`onnx_partition.calibrate.stage_modules`); write it to ``out`` (default: in place). Raises
    :class:`PartitionError` on bad counts or a plan whose model is gone."""
    folder = Path(folder)
    target = Path(out) if out is not None else folder
    if rounds < 1 or threads_per_stage < 1 or repeats < 1 or warmup < 0:
        raise PartitionError("--rounds, --threads and --repeats must be at least 1, --warmup "
                             "at least 0")
    plan = read_plan(folder)
    train = plan.mode == "train"
    if not plan.model or not (folder / plan.model).is_file():
        raise PartitionError(f"{folder}: the model the plan was cut from ({plan.model or '?'}) "
                             "is missing; calibration re-cuts it")
    model = (folder / plan.model).resolve()
    graph = load(model, input_shapes=plan.input_shapes)
    costs, backward = _base_costs(plan, graph)
    device = (plan.stages[0].devices or ["cpu"])[0]
    aside = target.parent / f".{target.name}.calibrating"
    shutil.rmtree(aside, ignore_errors=True)
    result = Calibration(plan, target)
    measured: list[tuple[float, Path, Plan, list[float], list[float]]] = []
    splits: list[list[float] | None] = []  # train, ZB-H1: each round's input-gradient ms
    current, current_dir = plan, folder
    try:
        for round_ in range(rounds):
            keys = stage_keys(current)
            priced = [sum(costs.get(k, 0.0) + (backward.get(k, 0.0) if train else 0.0)
                          for k in nodes) for nodes in keys]
            fwd, bwd, alone, split, side = _measure_round(
                current, current_dir, train, threads_per_stage=threads_per_stage,
                repeats=repeats, warmup=warmup)
            if train:
                splits.append(split)
                backward = reprice(backward, keys, bwd)
            together = [f + b for f, b in zip(fwd, bwd, strict=True)]
            bottleneck = _bottleneck(current, together)
            measured.append((bottleneck, current_dir, current, fwd, bwd))
            costs = reprice(costs, keys, fwd)
            result.rounds.append({
                "stages": [len(n) for n in keys], "priced_ms": [round(p, 6) for p in priced],
                "alone_ms": [round(t, 6) for t in alone],
                "together_ms": [round(t, 6) for t in together], **side,
                **({"forward_ms": [round(t, 6) for t in fwd],
                    "backward_ms": [round(t, 6) for t in bwd]} if train else {}),
                "bottleneck_ms": round(bottleneck, 6)})
            fresh = aside / f"round{round_ + 1}"
            proposal = _resolve(model, current, graph,
                                _costs_file(graph, costs, backward if train else None, device),
                                fresh)
            if _optimum_holds(result, proposal, keys, current, fwd, bwd):
                break
            if round_ + 1 == rounds:
                break
            current, current_dir = proposal, fresh
        _write_chosen(result, measured, splits, train, device, target,
                      threads_per_stage=threads_per_stage, repeats=repeats, warmup=warmup)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return result


def _measure_round(current: Plan, current_dir: Path, train: bool, *, threads_per_stage: int,
                   repeats: int, warmup: int
                   ) -> tuple[list[float], list[float], list[float], list[float] | None,
                              dict[str, Any]]:
    """One round's measurement of the plan in ``current_dir``: each stage's forward and
    backward ms side by side (inference: busy in the pipeline plus the hop overhead, backward
    0), alone, the input-gradient ms (train, ZB-H1; else None), and the round record's
    inference fields (side by side, in the pipeline, the hop)."""
    if train:
        from onnx_partition.calibrate.stage_modules import measure_train_plan

        got = measure_train_plan(current_dir, threads=threads_per_stage,
                                 repeats=repeats, warmup=warmup)
        fwd, bwd = got["forward_ms"], got["backward_ms"]
        alone = [f + b for f, b in zip(got["alone_forward_ms"],
                                       got["alone_backward_ms"], strict=True)]
        return fwd, bwd, alone, got.get("backward_input_ms"), {}
    times = measure_plan(current_dir, threads_per_stage=threads_per_stage,
                         repeats=repeats, warmup=warmup)
    wall, busy = pipeline_times(current_dir, threads_per_stage=threads_per_stage)
    hop = hop_overhead(current, busy, wall)
    fwd, bwd, alone = [b + hop for b in busy], [0.0] * len(stage_keys(current)), times.alone_ms
    return fwd, bwd, alone, None, {
        "side_by_side_ms": [round(t, 6) for t in times.together_ms],
        "pipeline_busy_ms": [round(t, 6) for t in busy],
        "pipeline_iteration_ms": round(wall, 6), "hop_ms": round(hop, 6)}


def _optimum_holds(result: Calibration, proposal: Plan, keys: list[list[str]], current: Plan,
                   fwd: Sequence[float], bwd: Sequence[float]) -> bool:
    """Whether the re-solved ``proposal`` leaves the measured plan at the calibrated optimum
    (the same stages, or a re-cut gaining under :data:`MIN_GAIN`), said in the round's
    ``resolved`` (and ``result.converged``)."""
    if stage_keys(proposal) == keys:
        result.converged = True
        result.rounds[-1]["resolved"] = "same stages"
        return True
    measured_now = copy.deepcopy(current)
    _calibrated(measured_now, fwd, bwd)
    if _score(proposal) >= (1.0 - MIN_GAIN) * _score(measured_now):
        result.converged = True
        result.rounds[-1]["resolved"] = (
            f"same stages (a re-cut gains under {MIN_GAIN:.0%}: "
            f"{_score(proposal):.4g} against {_score(measured_now):.4g} ms)")
        return True
    result.rounds[-1]["resolved"] = "moved: " + "/".join(
        str(len(s.nodes)) for s in proposal.stages)
    return False


def _write_chosen(result: Calibration, measured: Sequence[tuple[float, Path, Plan, list[float],
                                                               list[float]]],
                  splits: Sequence[list[float] | None], train: bool, device: str, target: Path,
                  *, threads_per_stage: int, repeats: int, warmup: int) -> None:
    """The measured plan of the least measured bottleneck (on a tie, the later) with its
    measured times (a train plan's engine also measured running it), and ``calibrated`` saying
    how, published to ``target``."""
    best = min(range(len(measured)), key=lambda i: (measured[i][0], -i))
    _, source, chosen, fwd, bwd = measured[best]
    result.chosen = best
    _calibrated(chosen, fwd, bwd)
    # its stage times are now measured side by side: partition's scaling no longer applies
    chosen.compute_scale = None
    engine_run: dict[str, Any] = {}
    if train:  # the engine's own work: optimizer steps, barriers and hops, as measured
        engine_run = _engine_measured(chosen, source, splits, best, bwd,
                                      threads_per_stage=threads_per_stage, repeats=repeats)
    chosen.calibrated = parse(Calibrated, {
        "by": "profile --plan", "executor": _executor(train), "device": device,
        "threads_per_stage": threads_per_stage, "repeats": repeats, "warmup": warmup,
        "side_by_side": ("processes, one per stage, each with the torch threads of a rank"
                         if train else "threads, one per stage replica, as run"),
        "converged": result.converged, "chosen_round": best + 1,
        "rounds": result.rounds, **({"engine_run": engine_run} if engine_run else {})},
        "plan.json calibrated")
    _publish(source, chosen, target)
    result.plan = chosen


def _engine_measured(chosen: Plan, source: Path, splits: Sequence[list[float] | None],
                     best: int, bwd: Sequence[float], *, threads_per_stage: int, repeats: int
                     ) -> dict[str, Any]:
    """A train plan's engine work measured: round ``best``'s input-gradient ms (ZB-H1), the
    engine's steps and hops, and the plan run in the engine itself (:func:`_run_calibrated`); what
    ``calibrated.engine_run`` records."""
    from onnx_partition.calibrate.stage_modules import (
        measure_train_engine,
        measure_train_run,
    )

    if splits[best] is not None and not chosen.simulator_costs.empty():
        chosen.simulator_costs.backward_input_ms = [
            round(t, 6) for t in splits[best] or []]

    engine = measure_train_engine(source, threads=threads_per_stage, repeats=repeats)
    _engine_calibrated(chosen, engine)
    run, schedule, count, (saved, peaks) = measure_train_run(source)
    share = None if splits[best] is None else [
        i / b if b > 0 else 0.5 for i, b in zip(splits[best] or [], bwd, strict=True)]
    record = _run_calibrated(chosen, run, schedule, count, engine["send_ms"], share)
    return {**record, "memory": memory_calibrated(chosen, saved, peaks)}
