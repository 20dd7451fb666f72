"""The one-line descriptions of a plan that the terminal summary (:mod:`onnx_partition.cli.summary`)
and the HTML page (:mod:`onnx_partition.report.page`) both show: what priced it
(:func:`priced_by`), the devices and links it assumed (:func:`devices_line`), its global batch
(:func:`batch_line`). They live here, below the command line, because the page needs them too."""

from __future__ import annotations

from onnx_partition.cost.aten import ANALYTIC_BACKWARD
from onnx_partition.cost.devices import DEFAULT_GPU
from onnx_partition.plan import Plan
from onnx_partition.plan.extras import CostsDevice, KindsDevice

__all__ = ["batch_line", "counted", "devices_line", "priced_by"]


def priced_by(plan: Plan) -> str:
    """One line naming what priced ``plan`` (its ``device_model``), for the summary."""
    model = plan.device_model
    if model is None:
        return "priced by: unknown (plan.json has no device_model)"
    backward = plan.costs.backward
    estimated = (
        "; backward estimated from forward (profile MODEL --mode train measures it in torch)"
        if plan.mode == "train" and backward not in ("measured", ANALYTIC_BACKWARD) else
        "; backward per aten op of the program (roofline)" if plan.mode == "train"
        and backward == ANALYTIC_BACKWARD else "")
    if isinstance(model, KindsDevice):  # a fleet: each GPU kind by its own model
        return "priced by: each GPU kind on its own: " + "; ".join(
            f"{kind} by costs file {m.file}" if isinstance(m, CostsDevice) else
            f"{kind} by the analytic roofline of {m.name}"
            for kind, m in model.kinds.items()) + estimated
    if isinstance(model, CostsDevice) and model.profiled:
        return (f"priced by: measured on this CPU ({model.profiled} {model.file}; --analytic "
                f"prices by the roofline){estimated}")
    if isinstance(model, CostsDevice):
        where = model.measured_on or "an unnamed device"
        return f"priced by: costs file {model.file} (measured on {where}){estimated}"
    named = (model.sources or {}).get("gpu", "default") != "default"
    default = " (the default GPU; --gpu NAME to change)" if str(model.name) in (
        f"{DEFAULT_GPU}:tf32", f"{DEFAULT_GPU}:bf16", f"{DEFAULT_GPU}:fp16") and not named \
        else ""
    source = f" ({model.figures_from})" if model.figures_from else ""
    return (f"priced by: analytic roofline of {model.name}{default}, "
            f"{model.peak_tflops:.4g} TFLOP/s dense, "
            f"{model.mem_gbps:.4g} GB/s{source}{estimated}")


def devices_line(plan: Plan) -> str:
    """One line: the device memory and links the plan assumed, and where each came from; a
    train plan whose hops the engine's measurements price (plan.json's ``engine_costs``) says
    so, with the ``send_ms`` the simulator plays (the link above it shaped only the cut), as
    does one whose link-model hops carry the probe's measured work per hop."""
    line = _links_line(plan)
    said = str(plan.engine_costs.send_ms or "")
    sends = plan.simulator_costs.send_ms if plan.mode == "train" else None
    measured = said.startswith(("measured", "calibrated"))
    if sends and (measured or "(the probe)" in said):  # the probe: link + measured work per hop
        hops = " / ".join(f"{float(x):.3g}" for x in sends)
        how = said.split(":", 1)[0] if measured else "the link model + the probe's work per hop"
        line += (f"; train hops priced as measured: {hops} ms "
                 f"({how}, plan.json engine_costs.send_ms)")
    return line


def _links_line(plan: Plan) -> str:
    sources = (plan.device_model.sources if plan.device_model is not None else None) or {}
    if not sources:
        link = plan.link
        return (f"link between stages: {link.bandwidth_gbps} GB/s, {link.latency_ms} ms"
                if link is not None else "devices: as plan.json says")
    if "memory" not in sources:
        return f"link between stages: {sources.get('link', '?')}"
    return (f"devices: memory {sources['memory']}; link within a machine "
            f"{sources.get('link', '?')}; between machines {sources.get('inter_link', '?')}")


def batch_line(plan: Plan, micro_batch: int | None = None,
               microbatches: int | None = None) -> str:
    """The global batch written out, as DeepSpeed users read it: micro-batch size x
    micro-batches per iteration; the micro-batches are shared among a stage's data-parallel
    replicas (micro-batch m goes to replica m mod d), which DeepSpeed calls gradient
    accumulation steps x data-parallel size."""
    m = microbatches or plan.microbatches
    size = micro_batch or plan.rows_per_microbatch
    what = f"micro-batch size {size}" if size else "micro-batch size B"
    total = f" = {size * m:,} sample{'s' * (size * m != 1)} per iteration" if size else ""
    replicas = sorted({s.replicas for s in plan.stages})
    if len(replicas) == 1 and m % replicas[0] == 0:
        d = replicas[0]
        share = (f" (DeepSpeed's terms: {counted(m // d, 'gradient accumulation step')} x "
                 f"{counted(d, 'data-parallel replica')})")
    else:
        share = ("; a stage with d data-parallel replicas gives each M/d of them (replicas per "
                 f"stage: {', '.join(str(s.replicas) for s in plan.stages)})")
    return f"global batch = {what} x {counted(m, 'micro-batch')}{total}{share}"


def counted(n: int, word: str) -> str:
    """``1 stage``, ``2 stages``, ``3 micro-batches``."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith(('ch', 'sh', 's', 'x')) else 's'}"
