"""The planner's one entry: ``plan(problem, request) -> Solution`` for every route (a plain
pipeline of ``--stages`` devices, a cluster of one device kind, a mixed fleet) and the schedule
a train plan runs, chosen among the planned ones by simulation. The problem is plain arrays
(:class:`Problem`: the units' DAG and the planners' per-unit arrays, built from the graph by
:func:`onnx_partition.pricing.problem_of`); the answer is numbers (:class:`Solution`), which
:mod:`onnx_partition.assemble` turns into a plan."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from onnx_partition.cost.cluster import Cluster, Fleet, Link
from onnx_partition.cost.engine_price import EngineTerms, split_ms
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.from_plan import comm_factor, stage_comm
from onnx_partition.pipeline.schedules import PLANNED_NAMES, build
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.progress import SILENT, Reporter
from onnx_partition.request.partition import PartitionRequest
from onnx_partition.settings.partition import AUTO, TrainSpec
from onnx_partition.solve.baselines import parameter_balanced, time_balanced, uniform
from onnx_partition.solve.contract import expand
from onnx_partition.solve.exact import Proof, exact_split
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec, node_arrays
from onnx_partition.solve.search import Candidate, best_split

if TYPE_CHECKING:
    from onnx_partition.solve.fleet import KindCosts
    from onnx_partition.solve.hybrid_proof import HybridProof
    from onnx_partition.solve.ilp import IlpResult
    from onnx_partition.solve.planner import Proposal

__all__ = ["BASELINES", "SOLVERS", "HybridRoute", "PipelineRoute", "Problem", "Solution",
           "StageFigures", "fastest_schedule", "plan", "plan_per_schedule"]

#: Baseline splits (one device per stage), for comparison: Megatron's and DeepSpeed's "uniform",
#: DeepSpeed's "parameters", torchgpipe's time balance (no communication).
BASELINES = ("uniform", "parameters", "time")
SOLVERS = ("dp", "ilp", *BASELINES)
#: A plain pipeline's optimizer state: AdamW's (weights, gradients, two moments).
_OPTIMIZER_FACTOR = RunSpec.optimizer_factor


@dataclass(frozen=True)
class StageFigures:
    """Per stage of a cut, summed over the nodes of its stage file: forward and backward ms
    (``split``), the input gradient's ms (``grad_input``) and the trainable tensors
    (``tensors``: ZB-H1's weight groups)."""

    split: list[tuple[float, float]]
    grad_input: list[float]
    tensors: list[int]


@dataclass(frozen=True)
class Problem:
    """What the planners plan, as plain arrays: the units' DAG (``dag``, priced for the
    route: a pipeline's on forward (+ backward in training) times over its link, a cluster's
    on forward times over its machine link), each unit's cut nodes (``members``, indices into
    ``nodes``, the graph index of each), the parameter bytes per unit (the baselines'), a
    cluster's per-unit arrays and a fleet's per-kind costs; the engine's terms (``engine``,
    ``split_call_ms`` per weight group, ``action_ms`` per action); ``figures``, the stage
    figures of an assignment (graph node -> stage, stage count), measured on its stage files;
    and whether the units are torch ops (``torch_ops``) rather than ONNX nodes."""

    dag: DagProblem
    nodes: list[int]
    members: list[list[int]]
    params: list[float]
    arrays: NodeArrays | None
    kinds: Mapping[str, KindCosts] | None
    engine: EngineTerms | None
    split_call_ms: float
    action_ms: float
    figures: Callable[[Mapping[int, int], int], StageFigures]
    torch_ops: bool = False

    def planned_over(self) -> dict[str, Any]:
        """plan.json's ``planned_over``: what the plan, and any proof of it, holds over: the
        units planned (``torch-ops``: one per torch op; ``onnx-nodes``: one per node, but
        for nodes joined so that no untyped value crosses a cut) and the cut ONNX nodes."""
        return {"granularity": "torch-ops" if self.torch_ops else "onnx-nodes",
                "units": len(self.members), "nodes": len(self.nodes)}


@dataclass(frozen=True)
class PipelineRoute:
    """What a plain pipeline's search found beside its cut: the ``link`` it was cut over, the
    slowest stage with its sends (``bottleneck_ms``) and all compute, each ordering's
    ``candidates`` (none for a baseline), the ILP's result or why it failed, the exact pass's
    ``proof`` (``--solver dp``), and a train plan's bytes per boundary (``hop_bytes``) and
    sends as its cut priced them (``send_ms``: the bytes over the link plus its latency, what
    ``simulate`` and ``report`` replay); both None in inference."""

    link: Link
    bottleneck_ms: float
    total_compute_ms: float
    candidates: Sequence[Candidate]
    ilp: IlpResult | None
    ilp_error: str | None
    proof: Proof | None
    hop_bytes: list[float] | None
    send_ms: list[float] | None


@dataclass(frozen=True)
class HybridRoute:
    """What the hybrid planner found: the ``cluster``, its ``best`` plan, each family's best
    simulated iteration (``families``), the ``run`` it was scored under, what is proven of
    the DP's objective (``proof``) and all compute at the cluster's speed."""

    cluster: Cluster | Fleet
    best: HybridPlan
    families: Mapping[str, Mapping[str, float]]
    run: RunSpec
    proof: HybridProof
    total_compute_ms: float


@dataclass(frozen=True)
class Solution:
    """A plan as numbers: each graph node's stage (``stage_of``), replicas and devices per
    stage, the ordering and solver named in plan.json, each stage's compute and comm ms, the
    schedule it runs (``infer`` for inference), the stages that recompute, a train plan's
    stage figures (a cluster's split as its planner scored it), the optimizer state's factor,
    each stage's GPU kind (a fleet's) and the route's own findings (``route``)."""

    stage_of: dict[int, int]
    replicas: list[int]
    devices: list[list[str]]
    ordering: str
    solver: str
    compute_ms: list[float]
    comm_ms: list[float]
    schedule: str
    recomputed: list[bool]
    figures: StageFigures | None
    optimizer_factor: float
    gpus: list[str] | None
    route: PipelineRoute | HybridRoute

    @property
    def num_stages(self) -> int:
        return len(self.replicas)


def plan(problem: Problem, request: PartitionRequest, *, reporter: Reporter = SILENT
         ) -> Solution:
    """The request's plan: without a cluster, exactly ``request.stages`` stages of one device
    each, the slowest minimised (:func:`_plan_pipeline`); on a cluster, stages and replicas
    per stage, fastest simulated iteration within device memory (:func:`_plan_hybrid`). The
    long steps report to ``reporter``."""
    cluster = request.devices.cluster
    if cluster is None:
        if request.stages is None:
            raise PartitionError("give --stages S, or a cluster (--devices N or --cluster FILE)")
        return _plan_pipeline(problem, request, request.stages, reporter)
    if request.search.solver != "dp":
        raise PartitionError(f"--solver {request.search.solver} plans pipelines without "
                             "replicas: drop the cluster options or use --solver dp")
    return _plan_hybrid(problem, request, cluster, reporter)


def _schedules(request: PartitionRequest) -> tuple[str, ...]:
    """The schedules a train plan is planned for: each planned one under ``auto``."""
    name = request.train.schedule
    return PLANNED_NAMES if name == AUTO else (name,)


def _plan_pipeline(problem: Problem, request: PartitionRequest, num_stages: int,
                   reporter: Reporter) -> Solution:
    """Sequence the DAG (every ordering for ``auto``), cut by DP, then prove the cut optimal
    or better it by CP-SAT (the exact budget, or the full ILP within its time limit for
    ``--solver ilp``); a baseline cuts as its tool would. A train plan runs the fastest
    simulated of its schedules on that split (:func:`fastest_schedule`), every stage
    recomputing under ``--recompute all`` (no memory limit: ``auto`` recomputes none)."""
    dag, search, train = problem.dag, request.search, request.training
    _check_stages(num_stages, dag.num_nodes)
    if search.solver not in SOLVERS:
        raise PartitionError(f"unknown solver {search.solver!r}; choose one of "
                             f"{', '.join(SOLVERS)}")
    candidates: Sequence[Candidate] = ()
    if search.solver in BASELINES:  # the splits other tools make, for comparison
        local, ordering = _baseline(search.solver, dag, problem.params, num_stages), "topo"
    else:
        best, candidates = best_split(dag, num_stages, search.ordering, reporter=reporter)
        local, ordering = best.stage_of, best.ordering
    ilp = ilp_error = proof = None
    if search.solver == "ilp":
        from onnx_partition.solve.ilp import solve_ilp  # OR-Tools, for this solver only

        try:
            ilp = solve_ilp(dag, num_stages, time_limit_s=search.time_limit_s, hint=local)
        except PartitionError as exc:  # no solution within the limit: keep the DP's plan
            ilp_error = str(exc)
        else:
            local = ilp.stage_of
    elif search.solver == "dp":  # exact where it is cheap: the DP's cut proven, or bettered
        proof = exact_split(dag, num_stages, local, budget_s=search.exact_budget_s)
        local = proof.stage_of
    times = dag.stage_times(local, num_stages)
    crossing = dag.cross_bytes(local, num_stages) if train and num_stages > 1 else []
    compute = [0.0] * num_stages
    for i, k in enumerate(local):
        compute[k] += dag.compute_ms[i]
    route = PipelineRoute(request.devices.link, max(times), sum(compute), candidates, ilp,
                          ilp_error, proof, [float(b) for b in crossing] if train else None,
                          [b / dag.bandwidth_bytes_per_ms + dag.latency_ms for b in crossing]
                          if train else None)
    stage_of = _graph_stages(problem, local)
    flags = [train and request.train.recompute == "all"] * num_stages
    figures = problem.figures(stage_of, num_stages) if train else None
    schedule = "infer"
    if figures is not None:
        schedule = fastest_schedule(
            _schedules(request), figures.split, figures.grad_input, flags, [1] * num_stages,
            route.send_ms, request.train.microbatches,
            split_ms(figures.tensors, problem.split_call_ms), problem.action_ms)
    return Solution(stage_of, [1] * num_stages, [["cpu"]] * num_stages, ordering,
                    search.solver, compute, [t - c for t, c in zip(times, compute)], schedule,
                    flags, figures, _OPTIMIZER_FACTOR, None, route)


def _plan_hybrid(problem: Problem, request: PartitionRequest, cluster: Cluster | Fleet,
                 reporter: Reporter) -> Solution:
    """Hybrid-parallel plan on ``cluster``: the fastest simulated plan of the hybrid DP, in
    training planned for each of its schedules (the fastest kept, the first on a tie), stages
    recomputing per ``--recompute`` (chosen per stage where memory is checked). A fleet's
    plan comes from :func:`~onnx_partition.solve.fleet.plan_fleet` (each stage's engine work
    and ZB-H1 split on its own kind) and names each stage's GPU kind. What is proven of the
    hybrid DP's objective within the exact budget is
    :func:`~onnx_partition.solve.hybrid_proof.prove_hybrid`'s. A ZB-H1 plan of one kind
    planned without the engine's terms runs under 1F1B where that is faster on its split with
    the split backward's and the actions' work (1F1B holds no more micro-batches than ZB-H1,
    so it fits where ZB-H1 did)."""
    from onnx_partition.solve.hybrid_proof import HybridProof, prove_hybrid  # a cluster's only

    dag, arrays, train, spec = problem.dag, problem.arrays, request.training, request.train
    assert arrays is not None
    num_stages = request.stages
    if num_stages is not None:
        _check_stages(num_stages, dag.num_nodes)
        if num_stages > cluster.devices:
            raise PartitionError(f"--stages {num_stages} needs at least {num_stages} devices; "
                                 f"the cluster has {cluster.devices}")
    gpus: list[str] | None = None
    if isinstance(cluster, Fleet):
        from onnx_partition.solve.fleet import plan_fleet

        assert problem.kinds is not None
        run = RunSpec(cluster.clusters[0], train=train, microbatches=spec.microbatches,
                      max_stages=max(16, num_stages or 0),
                      recompute=spec.recompute if train else "none", shard=spec.shard)
        fleet_plan, families = plan_fleet(dag, arrays, problem.kinds, cluster, run,
                                          schedules=_schedules(request) if train else (),
                                          num_stages=num_stages)
        run = replace(run, train_schedule=fleet_plan.schedule) if train else run
        best: HybridPlan = fleet_plan
        gpus, proof = fleet_plan.gpus, HybridProof(False, "fleet")
    else:
        schedules = _schedules(request) if train else ("infer",)
        engine = problem.engine if train else None
        # made once per memory model: every schedule plans from its own, and the proof
        # reuses their DP runs
        started = time.perf_counter()
        per_schedule = proposals_per_schedule(
            dag, arrays, cluster, schedules, num_stages=num_stages,
            microbatches=spec.microbatches, recompute=spec.recompute, train=train,
            engine=engine, shard=spec.shard)
        made_s = time.perf_counter() - started
        best, families, run = plan_per_schedule(
            dag, arrays, cluster, num_stages=num_stages, microbatches=spec.microbatches,
            schedules=schedules, recompute=spec.recompute, train=train, reporter=reporter,
            engine=engine, shard=spec.shard, proposals=per_schedule)
        best = replace(best, planning_s=best.planning_s + made_s)  # the proposals' time too
        proof = prove_hybrid(dag, arrays, run, best, num_stages=num_stages,
                             budget_s=request.search.exact_budget_s,
                             proposals=_given(per_schedule[run.schedule]))
    route = HybridRoute(cluster, best, families, run, proof, sum(dag.compute_ms) / cluster.speed)
    return _hybrid_solution(problem, request, route, gpus)


def _hybrid_solution(problem: Problem, request: PartitionRequest, route: HybridRoute,
                     gpus: list[str] | None) -> Solution:
    """A hybrid plan as a :class:`Solution`; a train plan's schedule: the planner's, or 1F1B
    in place of a ZB-H1 plan where :func:`fastest_schedule` finds it faster."""
    best, run, train = route.best, route.run, request.training
    stages = best.costs.stages
    compute = [s.forward_ms + s.backward_ms for s in stages]
    comm = stage_comm(best.costs.send_ms, comm_factor(run.train))
    stage_of = _graph_stages(problem, best.stage_of)
    flags = [s.recompute for s in stages] if train else [False] * best.num_stages
    figures = schedule = None
    if train:
        cut = problem.figures(stage_of, best.num_stages)
        figures = StageFigures([(s.forward_ms, s.backward_ms) for s in stages],
                               [s.split()[0] for s in stages], cut.tensors)
        weighed = (("zb-h1", "1f1b") if run.schedule == "zb-h1"
                   and "1f1b" in _schedules(request)
                   and (problem.split_call_ms > 0 or problem.action_ms > 0)
                   and run.engine is None and gpus is None  # else the planner weighed both
                   else (run.schedule,))  # (a fleet's with each kind's engine)
        schedule = fastest_schedule(weighed, figures.split, figures.grad_input, flags,
                                    best.replicas, list(best.costs.send_ms),
                                    request.train.microbatches,
                                    split_ms(figures.tensors, problem.split_call_ms),
                                    problem.action_ms)
    source = best.source
    return Solution(stage_of, list(best.replicas), [list(d) for d in best.devices],
                    source.partition(":")[2] if source.startswith("dp") else "topo",
                    f"hybrid-{source.partition(':')[0].removesuffix('+rc')}", compute, comm,
                    schedule or run.schedule, flags, figures, run.optimizer_factor, gpus,
                    route)


def _graph_stages(problem: Problem, unit_stage: Sequence[int]) -> dict[int, int]:
    """Each cut node's stage, by its graph index, from its unit's."""
    local = expand(list(unit_stage), problem.members, len(problem.nodes))
    return {problem.nodes[i]: k for i, k in enumerate(local)}


def _cluster_run(cluster: Cluster, schedule: str, *, num_stages: int | None,
                 microbatches: int, recompute: str, train: bool, engine: EngineTerms | None,
                 shard: str) -> RunSpec:
    """The run a cluster's plan is scored under for one schedule."""
    return RunSpec(cluster, train=train, microbatches=microbatches,
                   max_stages=max(16, num_stages or 0),
                   train_schedule=schedule if train else "1f1b",
                   recompute=recompute if train else "none", engine=engine, shard=shard)


def plan_per_schedule(
    problem: DagProblem, arrays: NodeArrays, cluster: Cluster, *, num_stages: int | None,
    microbatches: int, schedules: Sequence[str], recompute: str, train: bool,
    reporter: Reporter, engine: EngineTerms | None = None, shard: str = TrainSpec.shard,
    proposals: Mapping[str, Proposed] | None = None,
) -> tuple[HybridPlan, dict[str, dict[str, float]], RunSpec]:
    """:func:`~onnx_partition.solve.planner.plan_cluster` for each schedule: the fastest
    simulated plan (the first schedule on a tie), its families and run. When none fits, the
    first schedule's error. ``proposals``: the caller's :func:`~.planner.proposals_for` per
    schedule; made here otherwise, once per memory model (:func:`_memory_model`)."""
    from onnx_partition.solve.planner import plan_cluster  # a cluster's planner only

    found: list[tuple[HybridPlan, dict[str, dict[str, float]], RunSpec]] = []
    failed: PartitionError | None = None
    if proposals is None and len(schedules) > 1:
        proposals = proposals_per_schedule(
            problem, arrays, cluster, schedules, num_stages=num_stages,
            microbatches=microbatches, recompute=recompute, train=train, engine=engine,
            shard=shard)
    for name in schedules:
        run = _cluster_run(cluster, name, num_stages=num_stages, microbatches=microbatches,
                           recompute=recompute, train=train, engine=engine, shard=shard)
        try:
            given = None if proposals is None else _given(proposals[name])
            best, families = plan_cluster(problem, arrays, run, num_stages=num_stages,
                                          reporter=reporter, proposals=given)
        except PartitionError as exc:
            failed = failed or exc
            continue
        found.append((best, families, run))
    if not found:
        assert failed is not None
        raise failed
    return min(found, key=lambda f: f[0].sim.iteration_ms)


#: A schedule's proposals, or why its DP found none (that schedule then plans nothing).
Proposed: TypeAlias = "Sequence[Proposal] | PartitionError"


def proposals_per_schedule(
    problem: DagProblem, arrays: NodeArrays, cluster: Cluster, schedules: Sequence[str], *,
    num_stages: int | None, microbatches: int, recompute: str, train: bool,
    engine: EngineTerms | None, shard: str,
) -> dict[str, Proposed]:
    """:func:`~.planner.proposals_for` per schedule, made once per memory model
    (:func:`_memory_model`); a schedule whose DP finds no plan within memory gets the error,
    so ``auto`` still plans the others (1F1B where ZB-H1's kept gradients do not fit)."""
    from onnx_partition.solve.planner import HYBRID_ORDERINGS, proposals_for

    made: dict[str, Proposed] = {}
    out: dict[str, Proposed] = {}
    for name in schedules:
        memory = _memory_model(name, arrays, cluster, train)
        if memory not in made:
            run = _cluster_run(cluster, name, num_stages=num_stages,
                               microbatches=microbatches, recompute=recompute, train=train,
                               engine=engine, shard=shard)
            try:
                made[memory] = proposals_for(problem, arrays, run, num_stages,
                                             HYBRID_ORDERINGS)
            except PartitionError as exc:
                made[memory] = exc
        out[name] = made[memory]
    return out


def _given(proposed: Proposed) -> Sequence[Proposal]:
    """The proposals, or their schedule's error raised."""
    if isinstance(proposed, PartitionError):
        raise proposed
    return proposed


def _memory_model(schedule: str, arrays: NodeArrays, cluster: Cluster, train: bool) -> str:
    """Which memory the hybrid DP plans ``schedule`` under: ZB-H1's own where it keeps
    gradients from I to W under a memory limit (its DP then differs), else 1F1B's (the
    schedules' proposals are the same)."""
    if (train and schedule == "zb-h1" and math.isfinite(cluster.memory_bytes)
            and any(arrays.kept_bytes)):
        return "zb-h1"
    return "1f1b"


def fastest_schedule(schedules: Sequence[str], split: Sequence[tuple[float, float]],
                     grad_input: Sequence[float] | None, recompute: Sequence[bool],
                     replicas: Sequence[int], send_ms: Sequence[float] | None,
                     microbatches: int, split_cost: Sequence[float] | None = None,
                     action_ms: float = 0.0) -> str:
    """The schedule of ``schedules`` whose simulation of these stage costs is fastest (the
    first on a tie; one given: that one); ZB-H1 pays ``split_cost`` per stage (its split
    backward's overhead), every schedule ``action_ms`` per action (the engine's work: ZB-H1
    runs three actions per micro-batch and stage, 1F1B two)."""
    if len(schedules) == 1:
        return schedules[0]

    def costs(name: str) -> PipelineCosts:
        extra = split_cost if name == "zb-h1" and split_cost else [0.0] * len(split)
        stages = [StageCosts(f, b, r, backward_input_ms=grad_input[k] if grad_input else None,
                             recompute=rc, split_ms=extra[k], action_ms=action_ms)
                  for k, ((f, b), r, rc) in enumerate(zip(split, replicas, recompute,
                                                          strict=True))]
        return PipelineCosts(stages, list(send_ms or [0.0] * (len(stages) - 1)))

    times = [simulate(build(name, replicas, microbatches), costs(name)).iteration_ms
             for name in schedules]
    return schedules[times.index(min(times))]


def _baseline(
    name: str, problem: DagProblem, params: Sequence[float], num_stages: int
) -> list[int]:
    if name == "uniform":
        return uniform(problem, num_stages)
    if name == "parameters":
        return parameter_balanced(problem, node_arrays(problem, [0.0] * len(params), params),
                                  num_stages)
    return time_balanced(problem, num_stages)


def _check_stages(num_stages: int, n: int) -> None:
    if not 1 <= num_stages <= n:
        raise PartitionError(
            f"--stages {num_stages} is not possible: the model has {n} operators to cut"
        )
