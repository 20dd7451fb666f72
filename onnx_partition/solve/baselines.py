"""Baselines: the partitioners of the systems we compete with, each written from its source.

Every one is a pure function over plain data (a :class:`DagProblem`, per-node arrays, a
:class:`RunSpec`) and answers with ``stage_of`` (node -> stage over the problem's nodes) and,
where the method chooses them, ``replicas`` per stage. Splitting methods walk the problem's
topological order (Kahn's, smallest index first: the identity when nodes are numbered
topologically, as :func:`onnx_partition.graph_arrays.dag_problem` numbers them).

* :func:`uniform` -- DeepSpeed ``PipelineModule(partition_method="uniform")``
  (``deepspeed.runtime.utils.partition_uniform``), Megatron-LM's even split of layers:
  equal node counts, the first ``n mod S`` stages one node longer.
* :func:`parameter_balanced` -- DeepSpeed ``partition_method="parameters"``
  (``partition_balanced`` over per-layer parameter counts): binary search on the heaviest
  stage's weight with a greedy probe (``_rb_partition_balanced`` / ``_lprobe``).
* :func:`time_balanced` -- torchgpipe ``balance_by_time`` (Kim et al. 2020): per-layer forward
  times into ``torchgpipe.balance.blockpartition.solve``, Bárány and Grinberg's local moves
  ("Block partitions of sequences", Israel J. Math. 2015, arXiv:1308.2452). Communication,
  replication and memory are ignored, as there.
* :func:`data_parallel` -- one stage, every device a replica.
* :func:`pipedream` -- PipeDream's optimizer (Narayanan et al., "PipeDream: Generalized Pipeline
  Parallelism for DNN Training", SOSP 2019, section 3.1; ``optimizer/optimizer_graph_hierarchical
  .py`` in msr-fiddle/pipedream): a DP over the downsets ("antichain DAG" states) of the graph
  choosing stages and replica counts, in the paper's cost model.

The three splitters give a depth-``pp`` pipeline; :func:`best_grid` puts them on the Megatron
``pp x dp`` grid (every power-of-two ``pp`` dividing the devices, ``dp = D / pp`` replicas per
stage) and keeps the fastest plan that fits in memory. Every plan is scored like ours, by
:func:`onnx_partition.solve.planner.score` (the event simulator).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from onnx_partition.errors import PartitionError
from onnx_partition.solve.order.topo import assign
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec, score

__all__ = ["Assignment", "baseline_plans", "best_grid", "data_parallel", "fits",
           "parameter_balanced", "pipedream", "pipedream_cost", "time_balanced", "uniform"]

#: PipeDream gives up beyond this many downsets (Tarnawski et al. abort past 60k ideals).
MAX_STATES = 20_000


@dataclass(frozen=True)
class Assignment:
    stage_of: list[int]
    replicas: list[int]


# ------------------------------------------------------------------------------- splitters


def _check(problem: DagProblem, num_stages: int) -> list[int]:
    if not 1 <= num_stages <= problem.num_nodes:
        raise PartitionError(f"cannot split {problem.num_nodes} nodes into {num_stages} stages")
    return topological_order(problem)


def _nonempty(bounds: list[int], n: int) -> list[int]:
    """Give every empty stage one node from its neighbour, where the source left it empty
    (DeepSpeed's trailing stages, a block Bárány's moves emptied): ours need >= 1 node."""
    k = len(bounds) - 1
    for b in range(1, k):
        bounds[b] = max(bounds[b], bounds[b - 1] + 1)
    for b in range(k - 1, 0, -1):
        bounds[b] = min(bounds[b], bounds[b + 1] - 1)
    assert bounds[0] == 0 and bounds[k] == n and all(x < y for x, y in itertools.pairwise(bounds))
    return bounds


def uniform(problem: DagProblem, num_stages: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: ``chunk = n // S``, ``residual = n - chunk * S``;
    stage ``k`` holds ``chunk`` nodes plus one if ``k < residual``, in topological order."""
    order = _check(problem, num_stages)
    chunk, residual = divmod(len(order), num_stages)
    bounds = [k * chunk + min(k, residual) for k in range(num_stages + 1)]
    return assign(order, bounds)


def _greedy(prefix: np.ndarray, num_stages: int, limit: float) -> list[int] | None:
    """DeepSpeed's ``_lprobe``: each stage takes nodes while its weight stays within ``limit``
    (a binary search on the prefix sums); None if ``num_stages`` stages cannot cover all."""
    n, bounds = len(prefix) - 1, [0]
    slack = 1e-12 * max(float(prefix[-1]), 1.0)
    while bounds[-1] < n:
        start = bounds[-1]
        end = int(np.searchsorted(prefix, prefix[start] + limit + slack, side="right")) - 1
        if end <= start or len(bounds) > num_stages:
            return None
        bounds.append(min(end, n))
    return bounds


def _min_max(weights: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split minimising the heaviest stage (DeepSpeed's ``partition_balanced``):
    1. bisect the bottleneck between ``max(total / S, heaviest node)`` and ``total``, probing
       each guess greedily; 2. split greedily at the smallest feasible bottleneck (each stage as
       long as it can be, so spare stages fall at the end; they get a node each)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    total = float(prefix[-1])
    lo, hi = max(total / num_stages, max(weights, default=0.0)), total
    if _greedy(prefix, num_stages, lo) is not None:
        hi = lo
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if _greedy(prefix, num_stages, mid) is None:
            lo = mid
        else:
            hi = mid
    bounds = _greedy(prefix, num_stages, hi)
    assert bounds is not None
    return _nonempty(bounds + [len(weights)] * (num_stages + 1 - len(bounds)), len(weights))


def parameter_balanced(problem: DagProblem, arrays: NodeArrays, num_stages: int) -> list[int]:
    """DeepSpeed ``partition_method="parameters"``: ``partition_balanced`` (contiguous, the
    heaviest stage's parameter bytes minimised by binary search, see :func:`_min_max`) over
    the parameter bytes of the nodes in topological order. Compute is not looked at."""
    order = _check(problem, num_stages)
    if len(order) == num_stages:  # DeepSpeed: num_items <= num_parts -> partition_uniform
        return uniform(problem, num_stages)
    return assign(order, _min_max([arrays.param_bytes[v] for v in order], num_stages))


def time_balanced(problem: DagProblem, num_stages: int, *, exact: bool = False) -> list[int]:
    """torchgpipe ``balance_by_time``: forward times along the order into ``blockpartition.solve``
    (Bárány and Grinberg's algorithm, as torchgpipe writes it):

    0. normalise the times to ``[0, 1]`` (``(x - min) / (max - min)``); start from equal counts;
    1. fix a block ``p`` of the largest size ``M``;
    2. with ``m`` the smallest size, in the block ``q`` closest to ``p``: stop if ``M <= m + 1``;
    3. move one element into ``q`` from its neighbour ``h`` on ``p``'s side (the last element of
       ``q-1`` if ``p < q``, the first of ``q+1`` otherwise); if ``h == p`` go to 1, else to 2.

    Step 2 as in the paper: torchgpipe takes the smallest block of lowest index instead, which
    never stops once normalised sizes tie at 0 (many equally cheap operators: moves run past
    the sequence's end). ``exact=True`` gives the exact min-max split of the forward times.
    """
    order = _check(problem, num_stages)
    times = [problem.compute_ms[v] for v in order]
    if exact:
        return assign(order, _min_max(times, num_stages))
    n, k = len(times), num_stages
    low, span = min(times), max(times) - min(times)
    prefix = [0.0]
    for x in times:
        prefix.append(prefix[-1] + ((x - low) / span if span > 0 else 0.0))
    bounds = [0] + [n // k * (x + 1) for x in range(k - 1)] + [n]
    moves = 0
    while True:
        sizes = [prefix[bounds[i + 1]] - prefix[bounds[i]] for i in range(k)]
        max_size, p = max((size, i) for i, size in enumerate(sizes))
        while True:
            min_size = min(sizes)
            if max_size <= min_size + 1 + 1e-9:  # (prefix sums round)
                return assign(order, _nonempty(bounds, n))
            q = min((abs(i - p), i) for i, size in enumerate(sizes) if size == min_size)[1]
            h = q - 1 if p < q else q + 1
            bounds[max(q, h)] += -1 if p < q else 1  # the boundary between q and h
            for i in (q, h):
                sizes[i] = prefix[bounds[i + 1]] - prefix[bounds[i]]
            moves += 1
            if moves > 100 * n * k:  # the paper proves termination: never expected
                raise PartitionError("Bárány-Grinberg block partition did not converge")
            if p == h:
                break


def data_parallel(problem: DagProblem, devices: int) -> Assignment:
    """Plain data parallelism: the whole graph as one stage, replicated on every device."""
    if devices < 1:
        raise PartitionError(f"need at least one device, got {devices}")
    return Assignment([0] * problem.num_nodes, [devices])


# -------------------------------------------------------------------------------- PipeDream


def _stage_model(arrays: NodeArrays, problem: DagProblem, run: RunSpec
                 ) -> tuple[list[float], list[float], float]:
    """Per node compute (fwd [+ bwd], on the cluster's speed), per replica count the all-reduce
    factor ``4 (r-1) / (r B_r)`` (0 in inference), and the transfer factor ``2/B`` (``1/B``)."""
    speed = run.cluster.speed
    comp = [(f + (b if run.train else 0.0)) / speed
            for f, b in zip(problem.compute_ms, arrays.backward_ms)]
    ring = [0.0] + [4.0 * (r - 1) / (r * run.cluster.link(r).bytes_per_ms) if run.train else 0.0
                    for r in range(1, run.cluster.devices + 1)]
    return comp, ring, (2.0 if run.train else 1.0) / run.cluster.intra.bytes_per_ms


def pipedream_cost(problem: DagProblem, arrays: NodeArrays, run: RunSpec,
                   stage_of: Sequence[int], replicas: Sequence[int]) -> float:
    """PipeDream's objective for an assignment: the slowest of every stage's
    ``T = (compute + 4 (r-1) W / (r B)) / r`` and every boundary's ``2 C / B`` (activations
    forward, gradients back; ``C / B`` and no all-reduce in inference)."""
    comp, ring, per_byte = _stage_model(arrays, problem, run)
    num_stages = len(replicas)
    work, params = [0.0] * num_stages, [0.0] * num_stages
    for v, k in enumerate(stage_of):
        work[k] += comp[v]
        params[k] += arrays.param_bytes[v]
    worst = max((work[k] + ring[r] * params[k]) / r for k, r in enumerate(replicas))
    cross = problem.cross_bytes(stage_of, num_stages) if num_stages > 1 else []
    return max([worst, *(per_byte * c for c in cross)])


def _ideals(problem: DagProblem, max_states: int) -> tuple[list[int], list[int], list[int]]:
    """Every downset as a bitmask, by breadth-first search from the empty set, adding one node
    whose predecessors are all in (so in order of size: a sub-ideal always comes first); with
    the ideal each was first reached from and the node added."""
    n = problem.num_nodes
    preds = [0] * n
    succs: list[set[int]] = [set() for _ in range(n)]
    for p, cs in zip(problem.producer, problem.consumers):
        for c in cs:
            if p >= 0 and c != p:
                preds[c] |= 1 << p
                succs[p].add(c)
    ideals, parent, added = [0], [-1], [-1]
    index = {0: 0}
    ready = {0: frozenset(v for v in range(n) if preds[v] == 0)}
    for i, ideal in enumerate(ideals):  # grows while we walk it
        frontier = ready.pop(ideal)
        for v in frontier:
            grown = ideal | 1 << v
            if grown in index:
                continue
            if len(ideals) >= max_states:
                raise PartitionError(
                    f"PipeDream's antichain DP needs more than {max_states} states on this "
                    f"graph of {n} operators (branches explode the downsets)")
            index[grown] = len(ideals)
            ideals.append(grown)
            parent.append(i)
            added.append(v)
            ready[grown] = (frontier - {v}) | {
                w for w in succs[v] if preds[w] & grown == preds[w]}
    return ideals, parent, added


def _ideal_sums(problem: DagProblem, comp: Sequence[float], params: Sequence[float],
                parent: list[int], added: list[int]) -> tuple[np.ndarray, ...]:
    """Compute, parameter bytes and bytes leaving (relay model: tensors made inside or graph
    inputs, needed outside or graph outputs) of every ideal, each from its parent's."""
    made: list[list[int]] = [[] for _ in comp]
    read: list[set[int]] = [set() for _ in comp]
    needers = [0] * problem.num_tensors
    for t, (p, cs) in enumerate(zip(problem.producer, problem.consumers)):
        if p >= 0:
            made[p].append(t)
        for c in cs:
            read[c].add(t)
            needers[t] |= 1 << c
    leaves = [problem.nbytes[t] if problem.is_output[t] or problem.consumers[t] else 0.0
              for t in range(problem.num_tensors)]
    count = len(parent)
    work, par, out = np.zeros(count), np.zeros(count), np.zeros(count)
    out[0] = sum(leaves[t] for t, p in enumerate(problem.producer) if p < 0)
    masks = [0] * count
    for i in range(1, count):
        k, v = parent[i], added[i]
        masks[i] = masks[k] | 1 << v
        work[i], par[i] = work[k] + comp[v], par[k] + params[v]
        stays = sum(problem.nbytes[t] for t in read[v] if not problem.is_output[t]
                    and needers[t] & masks[i] == needers[t])
        out[i] = out[k] + sum(leaves[t] for t in made[v]) - stays
    return work, par, out


def pipedream(problem: DagProblem, arrays: NodeArrays, run: RunSpec, *,
              max_states: int = MAX_STATES, time_limit_s: float | None = None) -> Assignment:
    """PipeDream's partitioning DP (SOSP'19 section 3.1) over the downsets of the DAG:

    1. enumerate the downsets (ideals) ``S`` by BFS; past ``max_states`` raise PartitionError;
    2. ``A(S, m)``, the best time per micro-batch of ``S`` as a pipeline on at most ``m``
       devices, is ``T(S, m)`` (one stage) or ``min`` over sub-ideals ``S'`` and ``m' < m`` of
       ``max(A(S', m - m'), 2 C(S') / B, T(S \\ S', m'))``, with ``C(S')`` the bytes of the
       tensors leaving ``S'`` and ``T(stage, m') = (compute + 4 (m'-1) W / (m' B)) / m'``
       (compute = forward + backward, W its parameter bytes; inference: forward only, no
       all-reduce, ``C / B``). Fewer devices may be used ("use_fewer_machines");
    3. walk the choices back from ``A(all, devices)``.

    ``B`` is the cluster's link among ``m'`` devices for the all-reduce and the neighbour link
    for transfers. Memory is not constrained (PipeDream's flag, off by default). Raises
    PartitionError past ``time_limit_s`` seconds.
    """
    started = time.perf_counter()
    devices, n = run.cluster.devices, problem.num_nodes
    ideals, parent, added = _ideals(problem, max_states)
    comp, ring, per_byte = _stage_model(arrays, problem, run)
    work, params, out = _ideal_sums(problem, comp, arrays.param_bytes, parent, added)
    trans = per_byte * out
    trans[0] = 0.0  # nothing comes before the first stage
    count, words = len(ideals), max(1, (n + 63) // 64)
    packed = np.array([np.frombuffer(m.to_bytes(8 * words, "little"), dtype=np.uint64)
                       for m in ideals])
    best = np.full((count, devices + 1), math.inf)
    best[0, :] = 0.0
    split = np.zeros((count, devices + 1), dtype=np.int64)  # the sub-ideal before the stage
    reps = np.zeros((count, devices + 1), dtype=np.int64)  # the stage's replicas
    for j in range(1, count):
        if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
            raise PartitionError(f"PipeDream's DP ran past its {time_limit_s:g} s limit "
                                 f"({count} downsets, {devices} devices)")
        subs = np.flatnonzero(~np.any(packed[:j] & ~packed[j], axis=1))
        comp_k, par_k, trans_k, before = work[j] - work[subs], params[j] - params[subs], \
            trans[subs], best[subs]
        for r in range(1, devices + 1):
            stage = np.maximum((comp_k + ring[r] * par_k) / r, trans_k)
            cand = np.maximum(before[:, : devices + 1 - r], stage[:, None])
            pick = np.argmin(cand, axis=0)
            value = cand[pick, np.arange(devices + 1 - r)]
            better = value < best[j, r:]
            best[j, r:] = np.where(better, value, best[j, r:])
            split[j, r:] = np.where(better, subs[pick], split[j, r:])
            reps[j, r:] = np.where(better, r, reps[j, r:])
        for m in range(1, devices + 1):  # "use_fewer_machines"
            if best[j, m - 1] < best[j, m]:
                best[j, m], split[j, m], reps[j, m] = best[j, m - 1], split[j, m - 1], \
                    reps[j, m - 1]
    stages: list[tuple[int, int]] = []
    j, m = count - 1, devices
    while j != 0:
        k, r = int(split[j, m]), int(reps[j, m])
        stages.append((ideals[j] & ~ideals[k], r))
        j, m = k, m - r
    stages.reverse()
    stage_of = [0] * n
    for s, (mask, _) in enumerate(stages):
        for v in range(n):
            if mask >> v & 1:
                stage_of[v] = s
    return Assignment(stage_of, [r for _, r in stages])


# ------------------------------------------------------------------------------- the grid


def fits(plan: HybridPlan, run: RunSpec) -> bool:
    """Every stage within the device memory."""
    return max(plan.memory_bytes) <= run.cluster.memory_bytes


def best_grid(problem: DagProblem, arrays: NodeArrays, run: RunSpec,
              split_fn: Callable[[int], list[int]], source: str = "grid", *,
              device_counts: Sequence[int] = ()) -> HybridPlan | None:
    """The Megatron-style grid: for every ``pp`` in 1, 2, 4, ... with ``pp <= min(D, n)`` and
    ``D % pp == 0``, ``split_fn(pp)`` stages on ``D / pp`` replicas each, scored by simulation;
    the fastest plan within memory, or None if none fits. ``D`` is the cluster's device count,
    or each of ``device_counts`` (the grid on the first ``D`` devices only)."""
    best: HybridPlan | None = None
    for devices in device_counts or [run.cluster.devices]:
        pp = 1
        while pp <= min(devices, problem.num_nodes):
            if devices % pp == 0:
                plan = score(problem, arrays, split_fn(pp), [devices // pp] * pp, run,
                             f"{source}:pp{pp}")
                if fits(plan, run) and (best is None
                                        or plan.sim.iteration_ms < best.sim.iteration_ms):
                    best = plan
            pp *= 2
    return best


def baseline_plans(problem: DagProblem, arrays: NodeArrays, run: RunSpec, *,
                   pipedream_states: int = MAX_STATES, pipedream_time_s: float | None = None,
                   with_pipedream: bool = True,
                   split_cache: dict[tuple[str, int], list[int]] | None = None,
                   ) -> dict[str, HybridPlan | str]:
    """Every baseline's best plan, or why it has none ("OOM", "states", "timeout"); a plan's
    ``planning_s`` is PipeDream's solving time. ``split_cache`` keeps the splits (which depend
    on the problem and the depth only) across calls on the same problem."""
    cache = {} if split_cache is None else split_cache
    splitters: dict[str, Callable[[int], list[int]]] = {
        "uniform": lambda pp: uniform(problem, pp),
        "parameters": lambda pp: parameter_balanced(problem, arrays, pp),
        "time": lambda pp: time_balanced(problem, pp),
    }
    plans: dict[str, HybridPlan | str] = {}
    for name, split in splitters.items():
        def cached(pp: int, name: str = name, split: Callable[[int], list[int]] = split
                   ) -> list[int]:
            if (name, pp) not in cache:
                cache[name, pp] = split(pp)
            return cache[name, pp]
        plans[name] = best_grid(problem, arrays, run, cached, name) or "OOM"
    whole = data_parallel(problem, run.cluster.devices)
    dp_plan = score(problem, arrays, whole.stage_of, whole.replicas, run, "data-parallel")
    plans["data-parallel"] = dp_plan if fits(dp_plan, run) else "OOM"
    if not with_pipedream:
        return plans
    began = time.perf_counter()
    try:
        found = pipedream(problem, arrays, run, max_states=pipedream_states,
                          time_limit_s=pipedream_time_s)
    except PartitionError as exc:
        plans["pipedream"] = "timeout" if "limit" in str(exc) else "states"
    else:
        solved_s = time.perf_counter() - began
        pd_plan = score(problem, arrays, found.stage_of, found.replicas, run, "pipedream")
        pd_plan.planning_s = solved_s
        plans["pipedream"] = pd_plan if fits(pd_plan, run) else "OOM"
    return plans
