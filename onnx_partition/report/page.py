"""The HTML report of a plan: one self-contained page (tables, inline SVG charts, the
simulated schedule, the graph; the charts of time, memory and the schedule are drawn by
:mod:`onnx_partition.report.charts`). The lines the terminal prints are
:mod:`onnx_partition.cli.summary`'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load
from onnx_partition.pipeline.from_plan import (
    interleaving_note,
    over_memory_note,
    played_comm,
    played_comm_note,
    schedule_name,
    simulate_plan,
)
from onnx_partition.pipeline.predict import dumps, simulate_json
from onnx_partition.pipeline.simulate import PipelineCosts, SimResult
from onnx_partition.plan import PLAN_FILE, Plan, read_plan
from onnx_partition.plan.contracts import FleetFields, GroupFields
from onnx_partition.plan.folder import REPORT_MARK, is_our_report, manifest_of, verify, write_file
from onnx_partition.report.charts import (
    gantt_chart,
    html_note,
    memory_chart,
    stage_peaks,
    time_chart,
    warning_note,
    what_if,
)
from onnx_partition.report.lines import batch_line, counted, devices_line, priced_by
from onnx_partition.report.svg import (
    DagNode,
    esc,
    fmt_ms,
    layered_dag,
    stage_colour,
)
from onnx_partition.values import fmt_bytes, sig3

__all__ = ["FIGURES_ID", "MAX_DAG_NODES", "default_report_path",
           "measured_section", "report_figures", "report_html", "throughput_cards",
           "tokens_per_sample", "write_report"]


#: The id of the report's data element (:func:`report_figures`).
FIGURES_ID = "figures"


def default_report_path(plan_dir: Path) -> Path:
    """``PLAN.report.html`` beside the plan folder: re-partitioning the folder never touches
    it, and a user's own files in the folder are never overwritten."""
    folder = Path(plan_dir).resolve()
    return folder.with_name(f"{folder.name}.report.html")


# ----------------------------------------------------------------------------- HTML report

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#222;
 margin:0;background:#f4f5f7}
main{max-width:1360px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;margin:0 0 10px}
header dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0 16px;
 font-size:14px}
header dt{color:#555}header dd{margin:0;font-weight:600}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:14px 18px;
 margin:0 0 16px;overflow-x:auto}
table{border-collapse:collapse;font-size:13px}
th,td{padding:4px 10px;border-bottom:1px solid #e6e8eb;text-align:right;white-space:nowrap}
td.wrap{white-space:normal;max-width:420px}
th{background:#f0f2f5;font-weight:600}td.l,th.l{text-align:left}
tr.hot td{background:#fff4e5}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;
 vertical-align:-1px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:0 0 6px}
.card{border:1px solid #e1e4e8;border-radius:6px;padding:8px 12px;min-width:150px}
.card{max-width:300px}
.card b{display:block;font-size:18px}.card span{color:#555;font-size:12px}
.note{color:#555;font-size:13px;margin:6px 0 0}
main svg{max-width:100%;height:auto}
"""
#: The DAG is drawn operator by operator up to this many operators, condensed above.
MAX_DAG_NODES = 300


def write_report(
    plan_dir: Path, out: Path | None = None, *, schedule: str | None = None,
    microbatches: int | None = None, chunks: int | None = None,
    measured: Path | None = None, force: bool = False, hashes: bool = True,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Write one self-contained HTML page about the plan in ``plan_dir`` (default
    ``PLAN.report.html`` beside the folder: :func:`default_report_path`), atomically; returns
    its path. ``schedule``, ``microbatches`` and ``chunks`` go to :func:`simulate_plan`.
    ``measured``: a ``run --json`` file shown next to the simulation
    (:func:`measured_section`). ``warn`` is handed the what-if's :func:`over_memory_note`
    after the page is written (the page carries it too; the command line prints it on stderr,
    as ``simulate`` prints it). The folder is verified first (sizes, and sha256 when
    ``hashes``). An existing file is replaced only when it is an earlier report or ``force``
    is given; plan.json and the plan's own files never are. Raises PartitionError for a folder
    without a readable plan.json or a schedule the plan does not allow."""
    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    verify(plan_dir, plan, hashes=hashes)
    out = Path(out) if out is not None else default_report_path(plan_dir)
    root = plan_dir.resolve()
    owned = {root / PLAN_FILE} | {(root / name).resolve() for name in manifest_of(plan, plan_dir)}
    if out.resolve() in owned:
        raise PartitionError(f"{out} is a file of the plan; write the report elsewhere")
    result, costs = simulate_plan(plan, schedule=schedule, microbatches=microbatches,
                                  chunks=chunks)
    page = report_html(plan, plan_dir, result, costs, schedule=schedule,
                       microbatches=microbatches)
    if measured is not None:
        from onnx_partition.pipeline.predict import read_run

        section = measured_section(plan, read_run(measured), Path(measured).name)
        page = page.replace("</main>", section + "</main>", 1)
    path = write_file(out, page, replace=lambda path: force or is_our_report(path))
    note = over_memory_note(plan, result) if what_if(plan, result) else None
    if note and warn is not None:
        warn(note)
    return path


def report_html(plan: Plan, plan_dir: Path, result: SimResult, costs: PipelineCosts, *,
                schedule: str | None = None, microbatches: int | None = None) -> str:
    """The report page as a string (see :func:`write_report`). Its figures are also in the
    page as data (no script runs): ``<pre hidden id="figures">`` holds what ``simulate
    --json`` prints for the same ``schedule`` and ``microbatches`` (:func:`report_figures`)."""
    name = Path(plan.model).name or "model"
    figures = dumps(simulate_json(plan, result, schedule=schedule, microbatches=microbatches))
    other = result if what_if(plan, result) else None  # memory: the schedule simulated
    body = [
        f'<pre hidden id="{FIGURES_ID}">{esc(figures)}</pre>',
        f"<header><h1>Partition plan: {esc(name)}</h1>{_header(plan)}</header>",
        _summary(plan, result, warn=other is not None),
        _section("Stages", _stage_table(plan, other)),
        _section("Time per stage (one micro-batch, one replica)", time_chart(plan)),
        _section("Memory per device", memory_chart(plan, other)),
        _section("Simulated schedule", gantt_chart(plan, result, costs)),
        _section("Operator graph", _dag(plan, plan_dir)),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"{REPORT_MARK.decode()}<title>{esc(f'onnx-partition plan: {name}')}</title>"
            f"<style>{_CSS}</style>"
            "</head><body><main>" + "\n".join(body) + "</main></body></html>\n")


def report_figures(page: str) -> dict[str, Any]:
    """The figures a report page holds as data (see :func:`report_html`)."""
    import html
    import json

    start = page.index(f'id="{FIGURES_ID}">') + len(f'id="{FIGURES_ID}">')
    body: dict[str, Any] = json.loads(html.unescape(page[start:page.index("</pre>", start)]))
    return body


def _fleet_group(plan: Plan, group: GroupFields) -> str:
    """A fleet's group and the stages it runs: ``1 machine × 4 v100 (32 GB each, stages 1)``."""
    runs = [str(s.index) for s in plan.stages if group.gpu in (s.gpu or "").split("+")]
    memory = fmt_bytes(group.memory_gb * 1e9) if group.memory_gb is not None else "?"
    return (f"{group.machines} machine{'s' * (group.machines != 1)} × "
            f"{group.devices_per_machine} {group.gpu} ({memory} each, stages "
            f"{', '.join(runs) or 'none'})")


def _header(plan: Plan) -> str:
    """The facts a reader needs first: devices (kind, count, memory), where the costs came
    from, what was planned and by which version."""
    devices = sum(s.replicas for s in plan.stages)
    cluster = plan.cluster
    kinds = sorted({d.split("/")[-1].split(":")[0] for s in plan.stages for d in s.devices})
    kind = cluster.kind if cluster is not None else "/".join(kinds) or "cpu"
    where = f"{devices} × {kind}"
    if isinstance(cluster, FleetFields):  # a mixed fleet (cluster@2): each GPU kind and its stages
        where = f"{devices} used of a fleet: " + ", ".join(
            _fleet_group(plan, g) for g in cluster.groups)
    elif cluster is not None:
        where += (f" used of {cluster.machines} machine{'s' * (cluster.machines != 1)} × "
                  f"{cluster.devices_per_machine} (speed {sig3(float(cluster.speed))})")
        where += (f", {fmt_bytes(cluster.memory_gb * 1e9)} each"
                  if not math.isinf(cluster.memory_gb) else ", memory unlimited")
    source = plan.costs.source or "?"
    measured = plan.costs.measured_nodes
    if source.startswith("analytic:"):
        source = f"analytic roofline model of a {source.partition(':')[2]} device (not measured)"
    elif source != "?":
        source = f"profile file {source}"
    if measured:
        source += f" ({counted(int(measured), 'operator')} measured)"
    rows = [("devices", where), ("memory and links", devices_line(plan).removeprefix("devices: ")),
            ("costs", source),
            ("priced by", priced_by(plan).removeprefix("priced by: ")),
            ("plan", f"{plan.mode} · {counted(len(plan.stages), 'stage')} · "
                     f"ordering {plan.ordering} · solver {plan.solver}"),
            ("onnx-partition", plan.version or "?")]
    return "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows) + "</dl>"


def measured_section(plan: Plan, run: dict[str, Any], name: str = "run.json") -> str:
    """A measured run (``run --json``) next to the plan's simulation of that very run
    (:func:`onnx_partition.pipeline.predict.predict`, re-done here from plan.json): overall and per
    stage, with the ratio measured / predicted."""
    from onnx_partition.pipeline.predict import RunShape, predict, ratios

    replicas = [s.replicas for s in plan.stages]
    if run.get("replicas") != replicas:
        raise PartitionError(f"{name} is a run of another plan (replicas per stage "
                             f"{run.get('replicas')}, this plan's {replicas})")
    shape = RunShape(int(run["batch_size"]), int(run["microbatches"]))
    measured, predicted = run["measured"], predict(plan, shape)
    ratio = ratios(measured, predicted)

    def cell(value: float | None) -> str:
        return f"<td>{sig3(value) if value is not None else '-'}</td>"

    rows = [
        '<tr><td class="l">samples/s</td>' + cell(measured["samples_per_s"])
        + cell(predicted["samples_per_s"]) + cell(ratio["samples_per_s"])
        + "</tr>",
        '<tr><td class="l">iteration ms</td>' + cell(measured["iteration_ms"])
        + cell(predicted["iteration_ms"]) + cell(ratio["iteration_ms"]) + "</tr>",
    ]
    by_stage = {s["index"]: s for s in predicted["stages"]}
    for stage, value in zip(measured["stages"], ratio["stage_busy_ms"]):
        pred = by_stage.get(stage["index"], {}).get("busy_ms")
        rows.append(f'<tr><td class="l">stage {stage["index"]} busy ms (per replica)</td>'
                    + cell(stage["busy_ms"]) + cell(pred) + cell(value)
                    + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("measured", "predicted", "measured / predicted"))
    note = (f"{esc(name)}: {esc(str(run.get('runtime', '?')))} runtime, "
            f"{counted(shape.microbatches, 'micro-batch')} x {counted(shape.batch_size, 'row')}, "
            f"{measured.get('iterations', '?')} timed iterations. Predicted: the plan's "
            "forward-only simulation of the same micro-batches.")
    return _section("Measured run against the simulation",
                    f'<table><thead><tr><th class="l"></th>{head}</tr></thead>'
                    f'<tbody>{"".join(rows)}</tbody></table><p class="note">{note}</p>')


def _section(title: str, content: str) -> str:
    return f"<section><h2>{esc(title)}</h2>{content}</section>"


def tokens_per_sample(plan: Plan) -> int | None:
    """Tokens in one sample of a model with a sequence axis: the dims after the batch axis of
    its integer (token id) input, as partitioned; None for other models or an unknown length."""
    fixed = plan.input_shapes
    for spec in plan.inputs:
        if not spec.dtype.startswith(("int", "uint")) or len(spec.shape) != 2:
            continue
        length = fixed[spec.name][1] if len(fixed.get(spec.name, [])) == 2 else spec.shape[1]
        if isinstance(length, int) and length > 0:
            return length
    return None


def throughput_cards(plan: Plan, microbatches_per_s: float) -> list[tuple[str, str]]:
    """The headline figures a user thinks in: samples/s and, for a model with a sequence
    axis, tokens/s, then micro-batches/s (what the pipeline moves)."""
    cards = []
    rows = plan.rows_per_microbatch
    if rows:
        samples = microbatches_per_s * rows
        cards.append((f"{sig3(samples)} samples/s",
                      f"simulated throughput: micro-batches/s x {counted(rows, 'sample')} per "
                      "micro-batch"))
        tokens = tokens_per_sample(plan)
        if tokens:
            cards.append((f"{sig3(samples * tokens)} tokens/s",
                          f"samples/s x {counted(tokens, 'token')} per sample (the "
                          "sequence length partitioned for)"))
    cards.append((f"{sig3(microbatches_per_s)} micro-batches/s",
                  "micro-batches per iteration ÷ iteration time"))
    return cards


def _summary(plan: Plan, result: SimResult, *, warn: bool = False) -> str:
    """The headline cards and notes; ``warn``: a what-if result's :func:`over_memory_note`
    too."""
    num_mb = max((a.microbatch for _, a, _, _ in result.timeline), default=-1) + 1
    cards = [
        *throughput_cards(plan, result.throughput_per_s),
        (fmt_ms(result.iteration_ms), f"simulated iteration: {counted(num_mb, 'micro-batch')} "
                                      f"through the pipeline, {schedule_name(result)} schedule"),
        (f"{result.bubble_fraction * 100:.1f}%", "bubble: idle share of the devices' time in "
                                                  "the simulated iteration"),
    ]
    pred = plan.predicted
    if pred.iteration_ms is not None:
        cards.append((fmt_ms(pred.iteration_ms), "planner's simulated iteration when it chose "
                      "this plan (differs from the first card only with another schedule or "
                      "micro-batch count)"))
    if pred.bottleneck_ms is not None:
        cards.append((fmt_ms(pred.bottleneck_ms), "planner's bottleneck: the largest "
                      "(compute + comm) ÷ replicas over the stages (+ all-reduce ÷ micro-batches): "
                      "the steady time per micro-batch; a stage's own time is in the table"))
    html_cards = "".join(f'<div class="card"><b>{esc(v)}</b><span>{esc(k)}</span></div>'
                         for v, k in cards)
    notes = [batch_line(plan, microbatches=num_mb or None) + "."]
    if "iteration_ms" not in pred and num_mb:
        per_mb = result.iteration_ms / num_mb
        notes.append(f"Per micro-batch, the simulation takes {fmt_ms(per_mb)} (iteration ÷ "
                     f"{num_mb}, fill and drain included); the plain planner's bottleneck "
                     "charges each stage its sends on top of its compute, while the simulator "
                     "overlaps sends with the next compute.")
    warning = over_memory_note(plan, result) if warn else None
    return (f'<section><div class="cards">{html_cards}</div>'
            + "".join(html_note(n) for n in notes)
            + (warning_note(warning) if warning else "") + "</section>")


def _stage_table(plan: Plan, other: SimResult | None = None) -> str:
    """One row per stage; ``other``: a what-if result (:func:`what_if`), whose simulated peak
    memory the memory column shows instead of the planner's."""
    played = played_comm(plan)
    peaks = stage_peaks(plan, other) if other is not None else None
    head = ["stage", "operators", "first … last", "copied consts", "compute ms", "comm ms",
            *["comm ms (played)"] * (played is not None),
            "total ms", f"memory ({schedule_name(other)})" if other is not None else "memory",
            "in", "out", "replicas", "devices"]
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
            f"<td>{len(s.constants)}</td>", f"<td>{sig3(compute)}</td>", f"<td>{sig3(comm)}</td>",
            *([f"<td>{sig3(played[k])}</td>"] if played is not None else []),
            f"<td>{sig3(compute + comm)}</td>",
            f"<td>{esc(fmt_bytes(peaks[k] if peaks else pred.memory_bytes if pred else 0))}"
            "</td>",
            f"<td>{len(s.inputs)}</td>", f"<td>{len(s.outputs)}</td>", f"<td>{s.replicas}</td>",
            f'<td class="l wrap">{esc((f"{s.gpu}: " if s.gpu else "") + ", ".join(s.devices))}'
            "</td>",
        ]
        rows.append(f'<tr{" class=hot" if k == hot else ""}>' + "".join(cells) + "</tr>")
    header = "".join(f'<th class="{"l" if h in ("first … last", "devices") else ""}">'
                     f"{esc(h)}</th>" for h in head)
    note = played_comm_note(plan)
    memory = ("the planner's predicted peak per device" if other is None else
              f"the simulated peak of the stage's fullest device under {schedule_name(other)} "
              + ("(all the stages it hosts) " if interleaving_note(plan, other) else "")
              + "(see the memory chart)")
    return (f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            '<p class="note">Highlighted: the slowest stage per replica. Times are one '
            "micro-batch on one replica, in ms; comm counts both of a stage's boundaries. "
            "Copied consts: constant nodes copied into the stages that read them (not cut, so "
            f"not counted as operators); memory: {memory}.</p>"
            + (html_note(note[0].upper() + note[1:] + ".") if note else ""))


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _dag(plan: Plan, plan_dir: Path) -> str:
    count = sum(len(s.nodes) for s in plan.stages)
    path = plan_dir / plan.model if plan.model else None
    if path is None or not path.is_file():
        return html_note(f"Not drawn: the model file {plan.model or '(none)'} was not found "
                     "beside the plan folder.")
    shapes = plan.input_shapes or None
    try:
        graph = load(path, input_shapes=shapes)
    except (PartitionError, OSError, ValueError) as exc:
        return html_note(f"Not drawn: cannot load {plan.model}: {exc}")
    stage_of = {key: s.index for s in plan.stages for key in s.nodes}
    if count > MAX_DAG_NODES:
        return _condensed_dag(graph, stage_of, count)
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
            + html_note(f"{counted(len(index), 'operator')} in topological layers, top to "
                        f"bottom; red edges cross a stage boundary.{consts} Hover a node for "
                        "its key."))


def _condensed_dag(graph: OpGraph, stage_of: dict[str, int], count: int) -> str:
    from onnx_partition.report.dag_view import condense, draw

    groups, flows = condense(graph, stage_of)
    svg, engine = draw(groups, flows)
    return svg + html_note(
        f"{counted(count, 'operator')} condensed to {counted(len(groups), 'box')}: each stage "
        "(left to right in pipeline order) cut into runs of one repeated block (the exporter's "
        "module scopes, shared prefix left out), operator counts in brackets; edges carry the "
        f"bytes of one micro-batch, red ones cross a stage boundary. Drawn with {engine}.")
