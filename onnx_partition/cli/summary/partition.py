"""What ``partition`` prints: the stage table, the global batch, a train plan's tokens/s and MFU,
the planner's notes, what priced the plan, its devices and links, what is proven of its quality
(:func:`summary_lines`). What priced it and its devices are :mod:`onnx_partition.report.lines`'
(the HTML page shows them too)."""

from __future__ import annotations

import os
from math import inf, isfinite
from pathlib import Path
from typing import Any

from onnx_partition.cost.devices import gpu_spec
from onnx_partition.errors import PartitionError
from onnx_partition.mfu import model_parameters, train_rates
from onnx_partition.pipeline.from_plan import (
    default_schedule,
    played_comm,
    played_comm_note,
    recompute_note,
)
from onnx_partition.plan import Plan
from onnx_partition.plan.extras import (
    AnalyticDevice,
    HybridPeriodProof,
    PipelineProof,
    PlannedOver,
)
from onnx_partition.report.lines import batch_line, counted, devices_line, priced_by
from onnx_partition.report.page import throughput_cards, tokens_per_sample

__all__ = ["plan_table", "proof_line", "rates_line", "summary_lines", "train_figures"]


def summary_lines(plan: Plan, batch_size: int | None,
                  folder: str | os.PathLike[str] | None = None) -> list[str]:
    """``partition``'s summary on stdout: the table, the global batch (``batch_size``: the
    one asked for), a train plan's tokens and MFU (``folder``: the plan's, where its model
    is found), the planner's notes, what priced the plan, its devices and its quality."""
    rates = rates_line(plan, folder)
    lines = [plan_table(plan), batch_line(plan, batch_size), *([rates] if rates else []),
             *(plan.devices_notes or []), priced_by(plan), devices_line(plan)]
    quality = proof_line(plan)
    return lines + ([quality] if quality else [])


def _peak_flops(plan: Plan, kind: str | None) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU kind ``kind``, else of the plan's GPU (its
    cluster's, or the analytic model's); None on a CPU or an unknown device."""
    model = plan.device_model
    name = kind or getattr(plan.cluster, "gpu", None) or (
        model.name if isinstance(model, AnalyticDevice) and model.kind == "cuda" else None)
    try:
        return gpu_spec(name)[1].half_tflops * 1e12 if name else None
    except PartitionError:
        return None


def train_figures(plan: Plan, folder: str | os.PathLike[str] | None
                  ) -> dict[str, Any] | None:
    """A train plan's step in tokens (:mod:`onnx_partition.mfu`): parameters (the model's
    floating-point initializers; ``plan.model`` is relative to ``folder``, the plan's; None:
    not counted), tokens per step (micro-batches x rows x the sequence
    length), tokens/s, tokens/s per GPU used, the GPUs' bf16 peak and MFU (None where no GPU
    peak or parameter count is known); None for other plans (no token input, no step)."""
    step, rows, seq = plan.predicted.iteration_ms, plan.rows_per_microbatch, \
        tokens_per_sample(plan)
    if plan.mode != "train" or not rows or not seq or step is None or \
            not (isfinite(step) and step > 0):
        return None
    gpus = sum(s.replicas for s in plan.stages)
    peaks = [(_peak_flops(plan, s.gpu), s.replicas) for s in plan.stages]
    peak = sum(p * r for p, r in peaks if p) / gpus if all(p for p, _ in peaks) else None
    try:
        parameters: int | None = (model_parameters(Path(folder) / plan.model)
                                  if plan.model and folder is not None else None)
    except (OSError, ValueError):  # the model moved, or is not a readable ONNX file
        parameters = None
    tokens = plan.microbatches * rows * seq
    rates = train_rates(parameters or 0, tokens, float(step), gpus,
                        peak if parameters else None)
    return {"parameters": parameters, "tokens_per_step": tokens,
            "tokens_per_s": rates.tokens_per_s,
            "tokens_per_s_per_gpu": rates.tokens_per_s_per_gpu, "gpus": gpus,
            "peak_tflops": peak / 1e12 if peak else None, "mfu": rates.mfu}


def rates_line(plan: Plan, folder: str | os.PathLike[str] | None = None) -> str | None:
    """The summary's line of :func:`train_figures`; None where there are none."""
    got = train_figures(plan, folder)
    if got is None:
        return None
    unit = "CPU" if all(str(d).startswith("cpu") for s in plan.stages for d in s.devices) \
        else "GPU"  # a plan for CPUs (its devices named cpu): not "per GPU"
    line = (f"tokens: {got['tokens_per_step']:,} per iteration "
            f"({counted(plan.microbatches, 'micro-batch')} x "
            f"{counted(plan.rows_per_microbatch or 0, 'row')} x "
            f"{tokens_per_sample(plan):,}), {got['tokens_per_s']:,.0f} tokens/s, "
            f"{got['tokens_per_s_per_gpu']:,.0f} per {unit} ({counted(got['gpus'], unit)})")
    if got["mfu"] is None:
        why = "no GPU peak" if got["parameters"] else "the model's parameters are unknown"
        return f"{line}; MFU not known ({why})"
    return (f"{line}; MFU {got['mfu'] * 100:.3g}% (6 x {_count(got['parameters'])} "
            f"parameters x tokens / (iteration x GPUs x {got['peak_tflops']:,.1f} TFLOP/s "
            f"bf16 peak))")


def _count(n: int) -> str:
    """``405.9 B``, ``70.6 M``, ``1,234``."""
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:,}"


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
    rate = float(total.throughput_per_s) if total.throughput_per_s is not None else inf
    rates = ", ".join(v for v, _ in throughput_cards(plan, rate)) if rate < inf \
        else "inf micro-batches/s"
    if total.iteration_ms is not None:
        available = total.devices_available if total.devices_available is not None else "?"
        devices = (f"{total.devices_used} of {available} devices, "
                   if total.devices_used is not None else "")
        bottleneck = (f", bottleneck {total.bottleneck_ms:.3f} ms" if total.devices_used is None
                      and total.bottleneck_ms is not None else "")
        precision = plan.precision if plan.mode == "train" else None
        mode = f"{plan.mode} in {precision}" if precision not in (None, "fp32") else plan.mode
        lines.append(
            f"{mode}, ordering {plan.ordering}, solver {plan.solver}: {devices}"
            f"{counted(plan.microbatches, 'micro-batch')} per "
            f"iteration of {total.iteration_ms:.3f} ms (simulated, {default_schedule(plan)}),"
            f" bubble {(total.bubble_fraction or 0) * 100:.1f}%, {rates}{bottleneck}"
        )
        note = recompute_note(plan)
        if note:
            lines.append(note)
    elif not total.empty():
        lines.append(
            f"ordering {plan.ordering}, solver {plan.solver}: bottleneck "
            f"{total.bottleneck_ms or 0:.3f} ms, predicted {rates} "
            f"(whole model {total.total_compute_ms or 0:.3f} ms)"
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
                 "shard": "the optimizer state is sharded, which the hybrid judge does not "
                          "model",
                 "fleet": "the hybrid judge models one device kind, not a fleet"}


def _hybrid_proof_line(exact: HybridPeriodProof, over: PlannedOver | None = None) -> str:
    """:func:`proof_line` of a hybrid plan (plan.json's ``exact``,
    :mod:`~onnx_partition.solve.hybrid_proof`), of the units ``over`` says were planned: how
    far its simulated iteration may be from the fastest plan of the sequence (the bound every
    split of it meets), and what CP-SAT proved of the DP's bottleneck period there. "Proven
    optimal" only where the iteration meets the bound; a record written before the bound
    (no ``period_proven``) proved the period alone."""
    by = exact.by
    if by in _HYBRID_SHORT:
        return f"plan quality: not proven; {_HYBRID_SHORT[by]}"
    of = f" {over.phrase().replace('over', 'of', 1)}" if over is not None else ""
    where = (f"over the {exact.ordering} sequence ({exact.positions} blocks{of}, "
             f"{exact.devices} devices)" if exact.positions else f"on {exact.devices} devices")
    iteration = _iteration_clause(exact, where)
    if by == "size":
        judged = (f"CP-SAT judges the DP's bottleneck period up to {exact.max_cells} stage "
                  f"choices (blocks squared times stages) and {exact.max_devices} devices")
        return (f"plan quality: {iteration}; {judged}, so not here" if iteration else
                f"plan quality: not proven; {judged}: here {where}")
    first = f"plan quality: {iteration}; " if iteration else "plan quality: "
    period, plan_ms = exact.period_ms, exact.plan_period_ms
    if period is None:  # the DP found no plan of the sequence within memory
        agreed = ("CP-SAT agrees" if by == "none-fits" else "CP-SAT disagrees: please report"
                  if by == "disagree" else "CP-SAT's budget ran out")
        return (f"{first if iteration else 'plan quality: not proven; '}the DP finds no plan "
                f"{where} within memory without recomputation ({agreed}); the plan comes "
                f"from another proposal")
    chosen = (f"; the plan's own period {plan_ms:.6g} ms (+{(plan_ms / period - 1) * 100:.2f}%)"
              if period and plan_ms is not None and plan_ms > period * (1 + 1e-6) else
              "; the plan has it" if plan_ms is not None else
              "; the plan is not a split of that sequence")
    if by == "disagree":
        return (f"{first}CP-SAT found a bottleneck period below the DP's {period:.6g} ms "
                f"{where}: the DP missed a plan (please report){chosen}")
    least = (f"the DP's least bottleneck period, {period:.6g} ms per micro-batch," if iteration
             else f"the DP's least bottleneck period {where}, {period:.6g} ms per micro-batch,")
    proven = exact.period_proven
    if exact.proven_optimal if proven is None else proven:
        how = ("it meets the bound of all compute over all devices" if by == "bound"
               else f"CP-SAT, {exact.seconds or 0:.2f} s")
        return f"{first}{least} proven least ({how}){chosen}"
    gap = exact.gap if proven is None else exact.period_gap
    return (f"{first}{least} within {(gap or 0) * 100:.2f}% of the bound "
            f"{exact.lower_bound_ms or 0:.6g} ms (all compute over all devices); CP-SAT's "
            f"budget ran out (--exact-budget SECONDS to search longer){chosen}")


def _iteration_clause(exact: HybridPeriodProof, where: str) -> str:
    """What is proven of the plan's simulated iteration: that it meets the bound no plan
    ``where`` simulates below, or its gap to it ("" where the record has no bound)."""
    bound, iteration = exact.iteration_bound_ms, exact.iteration_ms
    if exact.period_proven is None or bound is None or iteration is None:
        return ""
    if exact.proven_optimal:
        return (f"proven optimal {where}: its simulated iteration, {iteration:.6g} ms, meets "
                f"the bound no split of the sequence simulates below")
    return (f"not proven optimal; simulated iteration {iteration:.6g} ms, within "
            f"{(exact.gap or 0) * 100:.2f}% of {bound:.6g} ms, a bound no plan {where} "
            f"simulates below (fill, drain and all-reduce counted)")


def proof_line(plan: Plan) -> str | None:
    """One line saying whether a pipeline plan is proven optimal, or its gap to the best lower
    bound (plan.json's ``exact``, or ``ilp`` for ``--solver ilp``); of a hybrid plan, what is
    proven of the DP's bottleneck period (:func:`_hybrid_proof_line`); None for other plans."""
    exact, ilp, units = plan.exact, plan.ilp, plan.planned_over
    over = f" {units.phrase()}" if units is not None else ""
    if isinstance(exact, HybridPeriodProof):
        return _hybrid_proof_line(exact, units)
    if isinstance(exact, PipelineProof):
        how = {"single": "one stage", "bound": "it meets the lower bound",
               "chain": "the DAG is a chain, cut exactly by the DP",
               "cp-sat": f"CP-SAT, {exact.seconds:.2f} s"}
        better = exact.dp_ms - exact.bottleneck_ms
        gained = (f"; {better / exact.dp_ms * 100:.2f}% faster than the DP's cut"
                  if better > 0 else "")
        if exact.proven_optimal:
            rounding = (f", to {exact.gap * 100:.4f}% (the integer model's rounding)"
                        if exact.gap > 0 else "")
            return (f"plan quality: proven optimal{over} ({how.get(exact.by, '?')}"
                    f"{rounding}){gained}")
        return (f"plan quality: within {exact.gap * 100:.2f}% of optimal{over} (lower bound "
                f"{exact.lower_bound_ms:.6g} ms); "
                f"{_SHORT.get(exact.by, 'not proven')}{gained}")
    if ilp is not None and ilp.optimal is not None:
        if ilp.optimal:
            return f"plan quality: proven optimal{over} (CP-SAT, {ilp.seconds or 0:.2f} s)"
        return (f"plan quality: within {(ilp.gap or 0) * 100:.2f}% of optimal{over} (lower bound "
                f"{ilp.lower_bound_ms or 0:.6g} ms); the time limit ran out")
    return None
