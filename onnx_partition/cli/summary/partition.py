"""What ``partition`` prints: the stage table, the global batch, the planner's notes, what
priced the plan, its devices and links, what is proven of its quality (:func:`summary_lines`).
What priced it and its devices are :mod:`onnx_partition.report.lines`' (the HTML page shows
them too)."""

from __future__ import annotations

from collections.abc import Mapping
from math import inf
from typing import Any

from onnx_partition.pipeline.from_plan import (
    default_schedule,
    played_comm,
    played_comm_note,
    recompute_note,
)
from onnx_partition.plan import Plan
from onnx_partition.report.lines import batch_line, counted, devices_line, priced_by
from onnx_partition.report.page import throughput_cards

__all__ = ["plan_table", "proof_line", "summary_lines"]


def summary_lines(plan: Plan, batch_size: int | None) -> list[str]:
    """``partition``'s summary on stdout: the table, the global batch (``batch_size``: the
    one asked for), the planner's notes, what priced the plan, its devices and its quality."""
    lines = [plan_table(plan), batch_line(plan, batch_size),
             *plan.extra.get("devices_notes", []), priced_by(plan), devices_line(plan)]
    quality = proof_line(plan)
    return lines + ([quality] if quality else [])


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def plan_table(plan: Plan) -> str:
    """One row per stage: operators, predicted compute and communication (and, for a train
    plan whose simulation plays other hop times, those: :func:`played_comm`), memory, cut
    tensors."""
    played = played_comm(plan)
    header: tuple[str, ...] = ("stage", "ops", "copied consts", "compute ms", "comm ms",
                               *("comm ms (played)",) * (played is not None),
                               "total ms", "memory MB", "in", "out", "replicas", "devices")
    fleet = any(stage.gpu for stage in plan.stages)  # a mixed fleet: which kind runs what
    header += ("gpu",) * fleet
    rows: list[tuple[str, ...]] = [header]
    for k, stage in enumerate(plan.stages):
        pred = stage.predicted
        compute = pred.compute_ms if pred else 0.0
        comm = pred.comm_ms if pred else 0.0
        rows.append((
            str(stage.index), str(len(stage.nodes)), str(len(stage.constants)),
            f"{compute:.3f}", f"{comm:.3f}",
            *((f"{played[k]:.3f}",) if played is not None else ()), f"{compute + comm:.3f}",
            _mb(pred.memory_bytes if pred else 0), str(len(stage.inputs)),
            str(len(stage.outputs)), str(stage.replicas), ",".join(stage.devices),
        ) + (str(stage.gpu or ""),) * fleet)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = plan.predicted
    rate = float(total.get("throughput_per_s", inf))
    rates = ", ".join(v for v, _ in throughput_cards(plan, rate)) if rate < inf \
        else "inf micro-batches/s"
    if "iteration_ms" in total:
        devices = (f"{total['devices_used']} of {total.get('devices_available', '?')} devices, "
                   if "devices_used" in total else "")
        bottleneck = (f", bottleneck {total['bottleneck_ms']:.3f} ms" if "devices_used" not in total
                      and "bottleneck_ms" in total else "")
        precision = plan.extra.get("precision") if plan.mode == "train" else None
        mode = f"{plan.mode} in {precision}" if precision not in (None, "fp32") else plan.mode
        lines.append(
            f"{mode}, ordering {plan.ordering}, solver {plan.solver}: {devices}"
            f"{counted(plan.microbatches, 'micro-batch')} per "
            f"iteration of {total['iteration_ms']:.3f} ms (simulated, {default_schedule(plan)}),"
            f" bubble {total.get('bubble_fraction', 0) * 100:.1f}%, {rates}{bottleneck}"
        )
        note = recompute_note(plan)
        if note:
            lines.append(note)
    elif total:
        lines.append(
            f"ordering {plan.ordering}, solver {plan.solver}: bottleneck "
            f"{total.get('bottleneck_ms', 0):.3f} ms, predicted {rates} "
            f"(whole model {total.get('total_compute_ms', 0):.3f} ms)"
        )
    lines.append("copied consts: constant nodes copied into the stage that reads them (they are "
                 "not cut); comm: both of a stage's boundaries; times per micro-batch.")
    note = played_comm_note(plan)
    if note:
        lines.append(note + ".")
    return "\n".join(lines)


#: Why an exact pass stopped short of a proof, for the summary.
_SHORT = {"budget": "the budget ran out (--exact-budget SECONDS to search longer)",
          "off": "exact search off (--exact-budget 0)",
          "size": "graph too large for the default exact search (--solver ilp to run it)"}


#: Why a hybrid plan's DP objective was not judged, for the summary.
_HYBRID_SHORT = {"off": "exact search off (--exact-budget 0)",
                 "recompute": "stages recompute, which the hybrid judge does not model",
                 "fleet": "the hybrid judge models one device kind, not a fleet"}


def _hybrid_proof_line(exact: Mapping[str, Any]) -> str:
    """:func:`proof_line` of a hybrid plan: what CP-SAT proved of the DP's bottleneck period
    over one sequence (plan.json's ``exact``, :mod:`~onnx_partition.solve.hybrid_proof`)."""
    by = exact.get("by", "")
    if by in _HYBRID_SHORT:
        return f"plan quality: not proven; {_HYBRID_SHORT[by]}"
    where = (f"over the {exact.get('ordering')} sequence ({exact.get('positions')} blocks, "
             f"{exact.get('devices')} devices)" if exact.get("positions") else
             f"on {exact.get('devices')} devices")
    if by == "size":
        return (f"plan quality: not proven; CP-SAT judges the DP's bottleneck period up to "
                f"{exact.get('max_cells')} stage choices (blocks squared times stages) and "
                f"{exact.get('max_devices')} devices: here {where}")
    period, plan_ms = exact.get("period_ms"), exact.get("plan_period_ms")
    if period is None:  # the DP found no plan of the sequence within memory
        agreed = ("CP-SAT agrees" if by == "none-fits" else "CP-SAT disagrees: please report"
                  if by == "disagree" else "CP-SAT's budget ran out")
        return (f"plan quality: not proven; the DP finds no plan {where} within memory "
                f"without recomputation ({agreed}); the plan comes from another proposal")
    chosen = ("; the plan, chosen by simulated iteration (not proven), has period "
              f"{plan_ms:.6g} ms (+{(plan_ms / period - 1) * 100:.2f}%)"
              if period and plan_ms is not None and plan_ms > period * (1 + 1e-6) else
              "; the plan, chosen by simulated iteration (not proven), has it"
              if plan_ms is not None else
              "; the plan, chosen by simulated iteration (not proven), is not a split of "
              "that sequence")
    if by == "disagree":
        return (f"plan quality: CP-SAT found a bottleneck period below the DP's "
                f"{period:.6g} ms {where}: the DP missed a plan (please report){chosen}")
    least = f"the DP's least bottleneck period {where}, {period:.6g} ms per micro-batch"
    if exact.get("proven_optimal"):
        how = ("it meets the bound of all compute over all devices" if by == "bound"
               else f"CP-SAT, {exact.get('seconds', 0):.2f} s")
        return f"plan quality: {least}, proven optimal ({how}){chosen}"
    return (f"plan quality: {least}, within {exact.get('gap', 0) * 100:.2f}% of the bound "
            f"{exact.get('lower_bound_ms', 0):.6g} ms (all compute over all devices); CP-SAT's "
            f"budget ran out (--exact-budget SECONDS to search longer){chosen}")


def proof_line(plan: Plan) -> str | None:
    """One line saying whether a pipeline plan is proven optimal, or its gap to the best lower
    bound (plan.json's ``exact``, or ``ilp`` for ``--solver ilp``); of a hybrid plan, what is
    proven of the DP's bottleneck period (:func:`_hybrid_proof_line`); None for other plans."""
    exact, ilp = plan.extra.get("exact"), plan.extra.get("ilp")
    if isinstance(exact, dict) and exact.get("kind") == "hybrid-period":
        return _hybrid_proof_line(exact)
    if isinstance(exact, dict):
        how = {"single": "one stage", "bound": "it meets the lower bound",
               "chain": "the DAG is a chain, cut exactly by the DP",
               "cp-sat": f"CP-SAT, {exact.get('seconds', 0):.2f} s"}
        better = exact.get("dp_ms", 0) - exact.get("bottleneck_ms", 0)
        gained = (f"; {better / exact['dp_ms'] * 100:.2f}% faster than the DP's cut"
                  if better > 0 else "")
        if exact.get("proven_optimal"):
            rounding = (f", to {exact['gap'] * 100:.4f}% (the integer model's rounding)"
                        if exact.get("gap", 0) > 0 else "")
            return (f"plan quality: proven optimal ({how.get(exact.get('by', ''), '?')}"
                    f"{rounding}){gained}")
        return (f"plan quality: within {exact.get('gap', 0) * 100:.2f}% of optimal (lower bound "
                f"{exact.get('lower_bound_ms', 0):.6g} ms); "
                f"{_SHORT.get(exact.get('by', ''), 'not proven')}{gained}")
    if isinstance(ilp, dict) and "optimal" in ilp:
        if ilp["optimal"]:
            return f"plan quality: proven optimal (CP-SAT, {ilp.get('seconds', 0):.2f} s)"
        return (f"plan quality: within {ilp.get('gap', 0) * 100:.2f}% of optimal (lower bound "
                f"{ilp.get('lower_bound_ms', 0):.6g} ms); the time limit ran out")
    return None
