"""Human-readable views of a plan: the text table printed by the CLI, and an HTML report
(one self-contained page: tables, inline SVG charts, the simulated schedule, the graph)."""

from __future__ import annotations

from math import inf
from pathlib import Path

from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.plan import PLAN_FILE, REPORT_FILE, Plan, read_plan
from onnx_partition.plan_sim import hosted_stages, interleaving_note, schedule_name, simulate_plan
from onnx_partition.plandir import REPORT_MARK, is_our_report, manifest_of, verify, write_file
from onnx_partition.simulate import PipelineCosts, SimResult, pipeline_width
from onnx_partition.svg import (
    ALLREDUCE,
    BACKWARD,
    COMM,
    FORWARD,
    Bar,
    DagNode,
    Segment,
    esc,
    fmt_bytes,
    gantt,
    hbar_chart,
    layered_dag,
    stage_colour,
)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def plan_table(plan: Plan) -> str:
    """One row per stage: operators, predicted compute and communication, memory, cut tensors."""
    header = ("stage", "ops", "consts", "compute ms", "comm ms", "total ms", "memory MB",
              "in", "out", "replicas", "devices")
    rows = [header]
    for stage in plan.stages:
        pred = stage.predicted
        compute = pred.compute_ms if pred else 0.0
        comm = pred.comm_ms if pred else 0.0
        rows.append((
            str(stage.index), str(len(stage.nodes)), str(len(stage.constants)),
            f"{compute:.3f}", f"{comm:.3f}", f"{compute + comm:.3f}",
            _mb(pred.memory_bytes if pred else 0), str(len(stage.inputs)),
            str(len(stage.outputs)), str(stage.replicas), ",".join(stage.devices),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = plan.predicted
    if "iteration_ms" in total:
        lines.append(
            f"{plan.mode}, ordering {plan.ordering}, solver {plan.solver}: "
            f"{total['devices_used']} of {total.get('devices_available', '?')} devices, "
            f"{total['microbatches']} micro-batches per "
            f"iteration of {total['iteration_ms']:.3f} ms (simulated), bubble "
            f"{total['bubble_fraction'] * 100:.1f}%, {total.get('throughput_per_s', inf):.1f} "
            f"micro-batches/s"
        )
    elif total:
        lines.append(
            f"ordering {plan.ordering}, solver {plan.solver}: bottleneck "
            f"{total.get('bottleneck_ms', 0):.3f} ms, predicted "
            f"{total.get('throughput_per_s', inf):.1f} micro-batches/s "
            f"(whole model {total.get('total_compute_ms', 0):.3f} ms)"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- HTML report

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#222;
 margin:0;background:#f4f5f7}
main{max-width:1360px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;margin:0 0 10px}
.meta{color:#555;margin:0 0 16px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:14px 18px;
 margin:0 0 16px;overflow-x:auto}
table{border-collapse:collapse;font-size:13px}
th,td{padding:4px 10px;border-bottom:1px solid #e6e8eb;text-align:right;white-space:nowrap}
th{background:#f0f2f5;font-weight:600}td.l,th.l{text-align:left}
tr.hot td{background:#fff4e5}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;
 vertical-align:-1px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:0 0 6px}
.card{border:1px solid #e1e4e8;border-radius:6px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:18px}.card span{color:#555;font-size:12px}
.note{color:#555;font-size:13px;margin:6px 0 0}
"""
#: The DAG is drawn for models with at most this many operators.
MAX_DAG_NODES = 300


def write_report(
    plan_dir: Path, out: Path | None = None, *, schedule: str | None = None,
    microbatches: int | None = None, chunks: int | None = None, force: bool = False,
    hashes: bool = True,
) -> Path:
    """Write one self-contained HTML page about the plan in ``plan_dir`` (default
    ``plan_dir/report.html``), atomically; returns its path. ``schedule``, ``microbatches``
    and ``chunks`` go to :func:`simulate_plan`. The folder is verified first (sizes, and
    sha256 when ``hashes``). An existing file is replaced only when it is an earlier report or
    ``force`` is given; plan.json and the plan's own files never are. Raises PartitionError for
    a folder without a readable plan.json or a schedule the plan does not allow."""
    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    verify(plan_dir, plan, hashes=hashes)
    out = Path(out) if out is not None else plan_dir / REPORT_FILE
    root = plan_dir.resolve()
    owned = {root / PLAN_FILE} | {(root / name).resolve() for name in manifest_of(plan, plan_dir)}
    if out.resolve() in owned:
        raise PartitionError(f"{out} is a file of the plan; write the report elsewhere")
    result, costs = simulate_plan(plan, schedule=schedule, microbatches=microbatches,
                                  chunks=chunks)
    page = report_html(plan, plan_dir, result, costs)
    return write_file(out, page, replace=lambda path: force or is_our_report(path))


def report_html(plan: Plan, plan_dir: Path, result: SimResult, costs: PipelineCosts) -> str:
    """The report page as a string (see :func:`write_report`)."""
    name = Path(plan.model).name or "model"
    devices = sum(s.replicas for s in plan.stages)
    costs_info = plan.extra.get("costs")
    source = costs_info.get("source", "?") if isinstance(costs_info, dict) else "?"
    meta = (f"{plan.mode} · ordering {plan.ordering} · solver {plan.solver} · "
            f"{len(plan.stages)} stages on {devices} devices · costs {source} · onnx-partition "
            f"{plan.extra.get('version', '?')}")
    body = [
        f"<h1>Partition plan: {esc(name)}</h1>",
        f'<p class="meta">{esc(meta)}</p>',
        _summary(plan, result),
        _section("Stages", _stage_table(plan)),
        _section("Time per stage (one micro-batch, one replica)", _time_chart(plan)),
        _section("Memory per device", _memory_chart(plan)),
        _section("Simulated schedule", _gantt(plan, result, costs)),
        _section("Operator graph", _dag(plan, plan_dir)),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"{REPORT_MARK.decode()}<title>{esc(f'onnx-partition plan: {name}')}</title>"
            f"<style>{_CSS}</style>"
            "</head><body><main>" + "\n".join(body) + "</main></body></html>\n")


def _section(title: str, content: str) -> str:
    return f"<section><h2>{esc(title)}</h2>{content}</section>"


def _summary(plan: Plan, result: SimResult) -> str:
    num_mb = max((a.microbatch for _, a, _, _ in result.timeline), default=-1) + 1
    cards = [
        (f"{result.iteration_ms:.4g} ms", f"simulated iteration ({num_mb} micro-batches, "
                                          f"{schedule_name(result)})"),
        (f"{result.throughput_per_s:,.1f}/s", "simulated micro-batches per second"),
        (f"{result.bubble_fraction * 100:.1f}%", "bubble (idle device time)"),
    ]
    pred = plan.predicted
    if "iteration_ms" in pred:
        cards.append((f"{pred['iteration_ms']:.4g} ms", "planner's predicted iteration"))
    if "bottleneck_ms" in pred:
        cards.append((f"{pred['bottleneck_ms']:.4g} ms", "planner's bottleneck per micro-batch"))
    html_cards = "".join(f'<div class="card"><b>{esc(v)}</b><span>{esc(k)}</span></div>'
                         for v, k in cards)
    note = ""
    if "iteration_ms" not in pred:
        note = ('<p class="note">The plain planner charges communication to each stage; the '
                "simulator overlaps sends with compute, so its throughput can be higher.</p>")
    return f'<section><div class="cards">{html_cards}</div>{note}</section>'


def _stage_table(plan: Plan) -> str:
    head = ["stage", "operators", "first … last", "consts", "compute ms", "comm ms", "total ms",
            "memory", "in", "out", "replicas", "devices"]
    load = [(s.predicted.compute_ms + s.predicted.comm_ms) / max(s.replicas, 1)
            if s.predicted else 0.0 for s in plan.stages]
    hot = max(range(len(load)), key=load.__getitem__) if load else -1
    rows = []
    for k, s in enumerate(plan.stages):
        pred = s.predicted
        compute, comm = (pred.compute_ms, pred.comm_ms) if pred else (0.0, 0.0)
        span = f"{s.nodes[0]} … {s.nodes[-1]}" if len(s.nodes) > 1 else "".join(s.nodes)
        cells = [
            f'<td class="l"><span class="swatch" style="background:{stage_colour(k)}"></span>'
            f"{s.index}</td>", f"<td>{len(s.nodes)}</td>",
            f'<td class="l" title="{esc(", ".join(s.nodes))}">{esc(_short(span, 48))}</td>',
            f"<td>{len(s.constants)}</td>", f"<td>{compute:.4f}</td>", f"<td>{comm:.4f}</td>",
            f"<td>{compute + comm:.4f}</td>",
            f"<td>{esc(fmt_bytes(pred.memory_bytes if pred else 0))}</td>",
            f"<td>{len(s.inputs)}</td>", f"<td>{len(s.outputs)}</td>", f"<td>{s.replicas}</td>",
            f'<td class="l">{esc(_short(", ".join(s.devices), 40))}</td>',
        ]
        rows.append(f'<tr{" class=hot" if k == hot else ""}>' + "".join(cells) + "</tr>")
    header = "".join(f'<th class="{"l" if h in ("first … last", "devices") else ""}">'
                     f"{esc(h)}</th>" for h in head)
    return (f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            '<p class="note">Highlighted: the slowest stage per replica. Times are per '
            "micro-batch; comm counts both of a stage's boundaries.</p>")


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _time_chart(plan: Plan) -> str:
    labels = [f"stage {s.index}" for s in plan.stages]
    rows, totals = [], []
    for s in plan.stages:
        c, m = (s.predicted.compute_ms, s.predicted.comm_ms) if s.predicted else (0.0, 0.0)
        rows.append([Segment(c, stage_colour(s.index), f"stage {s.index} compute {c:.4f} ms"),
                     Segment(m, COMM, f"stage {s.index} communication {m:.4f} ms")])
        totals.append(f"{c:.4g} + {m:.4g} = {c + m:.4g} ms")
    return hbar_chart(labels, rows, unit="ms", value_text=totals,
                      legend_items=[("compute (stage colour)", stage_colour(0)),
                                    ("communication", COMM)])


def _memory_chart(plan: Plan) -> str:
    raw = plan.extra.get("cluster")
    limit_gb = raw.get("memory_gb") if isinstance(raw, dict) else None
    limit = float(limit_gb) * 1e9 if isinstance(limit_gb, int | float) else None
    labels, rows, texts = [], [], []
    for s in plan.stages:
        used = float(s.predicted.memory_bytes) if s.predicted else 0.0
        for r in range(s.replicas):
            where = s.devices[r] if r < len(s.devices) else "?"
            labels.append(f"stage {s.index} · replica {r} · {where}")
            rows.append([Segment(used, stage_colour(s.index), f"{fmt_bytes(used)}")])
            share = f" ({used / limit * 100:.1f}% of limit)" if limit else ""
            texts.append(fmt_bytes(used) + share)
    peak = max((row[0].value for row in rows), default=0.0)
    drawn = limit if limit is not None and limit <= 4 * max(peak, 1.0) else None
    chart = hbar_chart(labels, rows, unit="memory", value_text=texts, limit=drawn,
                       limit_label=f"device limit {fmt_bytes(limit or 0)}",
                       tick_format=fmt_bytes)
    if limit is None:
        note = "No device memory limit in plan.json (no cluster, or unlimited memory)."
    elif drawn is None:
        note = (f"Device limit {fmt_bytes(limit)} is off the scale: the largest use is "
                f"{peak / limit * 100:.2g}% of it.")
    else:
        note = f"Dashed line: the device memory limit, {fmt_bytes(limit)}."
    what = ("weights, optimizer state and stashed activations" if plan.mode == "train"
            else "weights and the stage's input and output tensors" if "iteration_ms"
            not in plan.predicted else "weights and activations of one micro-batch")
    return chart + _note(f"Planner's predicted peak per device ({what}). {note}")


def _gantt(plan: Plan, result: SimResult, costs: PipelineCosts) -> str:
    devices = sorted(result.busy_ms)
    row_of = {dev: i for i, dev in enumerate(devices)}
    hosted = hosted_stages(plan, result)
    width = pipeline_width(devices, len(costs.stages))  # < stages when interleaved
    names = []
    for s, r in devices:
        if len(hosted[(s, r)]) > 1:  # interleaved what-if: plan.json's devices do not apply
            names.append(f"device {s} · replica {r} · stages "
                         f"{', '.join(map(str, hosted[(s, r)]))}")
            continue
        where = plan.stages[s].devices[r] if r < len(plan.stages[s].devices) else "?"
        names.append(f"stage {s} · replica {r} · {where}")
    bars = []
    for dev, action, t0, t1 in result.timeline:
        forward = action.kind.value == "F"
        what = "forward" if forward else "backward"
        bars.append(Bar(row_of[dev], t0, t1, FORWARD if forward else BACKWARD,
                        str(action.microbatch),
                        f"{action}: stage {action.stage} {what} of micro-batch "
                        f"{action.microbatch}, {t0:.4f}–{t1:.4f} ms"))
    for stage, (t0, t1) in sorted(result.allreduce.items()):
        for r in range(costs.stages[stage].replicas):
            bars.append(Bar(row_of[(stage % width, r)], t0, t1, ALLREDUCE, "all-reduce",
                            f"stage {stage} gradient all-reduce, {t0:.4f}–{t1:.4f} ms",
                            faint=True))
    items = [("forward", FORWARD)]
    if any(a.kind.value == "B" for _, a, _, _ in result.timeline):
        items.append(("backward", BACKWARD))
    if result.allreduce:
        items.append(("gradient all-reduce", ALLREDUCE))
    chart = gantt(names, bars, total=result.iteration_ms, legend_items=items)
    sends = ", ".join(f"{s:.4g}" for s in costs.send_ms) or "none"
    what_if = interleaving_note(plan, result)
    extra = f" {esc(what_if[0].upper() + what_if[1:])}." if what_if else ""
    return (chart + f'<p class="note">{esc(schedule_name(result))} schedule rebuilt from '
            f"plan.json; numbers on bars are micro-batches. Send time per boundary (ms): "
            f"{esc(sends)}. Bubble {result.bubble_fraction * 100:.1f}%.{extra}</p>")


def _dag(plan: Plan, plan_dir: Path) -> str:
    count = sum(len(s.nodes) for s in plan.stages)
    if count > MAX_DAG_NODES:
        return _note(f"Not drawn: {count} operators (the graph is drawn up to "
                     f"{MAX_DAG_NODES}).")
    path = plan_dir / plan.model if plan.model else None
    if path is None or not path.is_file():
        return _note(f"Not drawn: the model file {plan.model or '(none)'} was not found "
                     "beside the plan folder.")
    shapes = plan.extra.get("input_shapes") or None
    try:
        graph = load(path, input_shapes=shapes)
    except (PartitionError, OSError, ValueError) as exc:
        return _note(f"Not drawn: cannot load {plan.model}: {exc}")
    stage_of = {key: s.index for s in plan.stages for key in s.nodes}
    index: dict[int, int] = {}
    nodes: list[DagNode] = []
    for n in graph.nodes:
        if n.free:
            continue
        index[n.index] = len(nodes)
        k = stage_of.get(n.key)
        where = f"stage {k}" if k is not None else "not in the plan"
        nodes.append(DagNode(n.op_type, f"{n.key} ({n.op_type}), {where}",
                             stage_colour(k) if k is not None else "#999"))
    edges: set[tuple[int, int, bool]] = set()
    tensors = graph.tensors
    for name in graph.inputs:
        nodes.append(DagNode(name, f"graph input {name}", "#e8eaed", pill=True))
        for c in tensors[name].consumers if name in tensors else ():
            if c in index:
                edges.add((len(nodes) - 1, index[c], False))
    for info in tensors.values():
        if info.producer in index:
            u = index[info.producer]
            for c in info.consumers:
                if c in index and c != info.producer:
                    hot = nodes[u].colour != nodes[index[c]].colour
                    edges.add((u, index[c], hot))
    for name in graph.outputs:
        prod = tensors[name].producer if name in tensors else -1
        nodes.append(DagNode(name, f"graph output {name}", "#e8eaed", pill=True))
        if prod in index:
            edges.add((index[prod], len(nodes) - 1, False))
    legend_items = [(f"stage {s.index}", stage_colour(s.index)) for s in plan.stages[:16]]
    free = sum(n.free for n in graph.nodes)
    consts = (f" {free} constant node{'s' * (free != 1)} (copied into the stages that need "
              "them) not drawn." if free else "")
    return (layered_dag(nodes, sorted(edges), legend_items=legend_items)
            + _note(f"{len(index)} operators in topological layers, top to bottom; red edges "
                    f"cross a stage boundary.{consts} Hover a node for its key."))


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'
