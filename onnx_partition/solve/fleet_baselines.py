"""The fleet's baselines, each planned by the one-kind planner: every device as the slowest kind
(:func:`as_slowest`; :mod:`.fleet` scores its plan among the candidates, so the fleet's plan is
never slower) and the fastest group alone (:func:`fastest_alone`); :func:`kind_problem` prices
the problem on one kind for that planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from onnx_partition.cost.cluster import Cluster, Fleet, Link
from onnx_partition.solve.fleet_scoring import KindCosts
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec

__all__ = ["as_slowest", "fastest_alone", "kind_problem", "slowest_cluster", "slowest_costs"]


def kind_problem(problem: DagProblem, arrays: NodeArrays, costs: KindCosts
                 ) -> tuple[DagProblem, NodeArrays]:
    """The problem and node arrays priced on one kind (for the one-kind planner)."""
    return (problem.reweighted(costs.forward_ms, problem.nbytes),
            replace(arrays, backward_ms=list(costs.backward_ms),
                    backward_input_ms=list(costs.backward_input_ms)))


def slowest_costs(kinds: Mapping[str, KindCosts]) -> KindCosts:
    """Every node at its slowest kind's times (node by node: the slowest GPU where one GPU is
    slower at everything, as a V100 beside an A100), with the engine of the kind of most
    work."""
    table = list(kinds.values())
    slowest = max(table, key=lambda c: float(sum(c.forward_ms) + sum(c.backward_ms)))
    return KindCosts([max(c.forward_ms[v] for c in table) for v in
                      range(len(table[0].forward_ms))],
                     [max(c.backward_ms[v] for c in table) for v in
                      range(len(table[0].backward_ms))],
                     slowest.engine,  # the engine of the kind of most work
                     [max(c.backward_input_ms[v] for c in table) for v in
                      range(len(table[0].backward_input_ms))]
                     if all(len(c.backward_input_ms) for c in table) else [])


def slowest_cluster(fleet: Fleet) -> Cluster:
    """Every device of ``fleet`` as the slowest kind in one cluster: the least memory, the
    slowest machine link, the fleet's ``inter`` link, and the fleet's machines when every group
    has as many devices per machine (else each device a machine of its own: what cluster@1
    can state without claiming a link the fleet lacks)."""
    per = {g.devices_per_machine for g in fleet.groups}
    slow = min((g.intra for g in fleet.groups),
               key=lambda link: (link.bytes_per_ms, -link.latency_ms))
    worst = Link(slow.bandwidth_gbps, max(g.intra.latency_ms for g in fleet.groups))
    shape = ((sum(g.machines for g in fleet.groups), per.pop()) if len(per) == 1
             else (fleet.devices, 1))
    return Cluster(machines=shape[0], devices_per_machine=shape[1],
                   memory_gb=min(g.memory for g in fleet.groups), kind="cuda",
                   intra=worst, inter=fleet.inter)


def as_slowest(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
               fleet: Fleet, run: RunSpec, num_stages: int | None = None
               ) -> tuple[HybridPlan, Cluster]:
    """Baseline: the one-kind planner's plan with every device treated as the slowest kind
    (:func:`slowest_costs` on :func:`slowest_cluster`), as a cluster@1 of the slowest GPU
    would be planned (``num_stages`` deep where given); its ``sim`` is that plan's time
    there."""
    from onnx_partition.solve.planner import plan_cluster

    cluster = slowest_cluster(fleet)
    sub_problem, sub_arrays = kind_problem(problem, arrays, slowest_costs(kinds))
    plan, _ = plan_cluster(sub_problem, sub_arrays, replace(run, cluster=cluster,
                                                            engine=slowest_costs(kinds).engine),
                           num_stages=num_stages)
    return plan, cluster


def fastest_alone(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                  fleet: Fleet, run: RunSpec) -> HybridPlan:
    """Baseline: the one-kind planner on the fastest group alone (least work per device
    times its devices, i.e. the group of most compute)."""
    from onnx_partition.solve.planner import plan_cluster

    def work(g: int) -> float:
        c = kinds[fleet.groups[g].gpu]
        total = sum(c.forward_ms) + (sum(c.backward_ms) if run.train else 0.0)
        return float(total) / fleet.groups[g].devices

    g = min(range(len(fleet.groups)), key=work)
    gpu = fleet.groups[g].gpu
    sub_problem, sub_arrays = kind_problem(problem, arrays, kinds[gpu])
    plan, _ = plan_cluster(sub_problem, sub_arrays, replace(
        run, cluster=fleet.groups[g].cluster(fleet.inter), engine=kinds[gpu].engine))
    return plan
