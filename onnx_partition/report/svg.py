"""Hand-drawn inline SVG for the HTML report: bar charts, a Gantt chart, a layered DAG.

Plain data in, an ``<svg>`` string out; every text is escaped. No scripts, no external assets:
hover text uses SVG ``<title>`` elements.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import networkx as nx

from onnx_partition.values import sig3

__all__ = ["ALLREDUCE", "BACKWARD", "COMM", "FONT", "FORWARD", "HATCH", "HATCH_ID", "Bar",
           "ColumnBox", "DagNode", "Segment", "esc", "fmt_ms", "fmt_num", "gantt", "hbar_chart",
           "layered_dag", "legend", "nice_ticks", "stage_colour", "stage_columns", "text_on",
           "text_width"]

FONT = "font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"
_STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                  "#b07aa1", "#ff9da7", "#9c755f", "#6f4e7c")
# Stages own the palette; what a bar is (forward, backward, all-reduce, communication) is drawn
# with neutral greys, hatching and outlines, never with a colour a stage could have.
FORWARD = "#6b7280"  # legend swatch: solid
BACKWARD = "#6b7280"  # legend swatch: hatched
ALLREDUCE = "#ffffff"  # white with a dashed dark outline
COMM = "#c9ccd1"
HATCH_ID = "op-hatch"
HATCH = (f'<defs><pattern id="{HATCH_ID}" width="6" height="6" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="3" height="6" fill="#fff" '
         'fill-opacity="0.55"/></pattern></defs>')


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def stage_colour(stage: int) -> str:
    """Tableau-10 colours, then evenly spread hues."""
    if 0 <= stage < len(_STAGE_COLOURS):
        return _STAGE_COLOURS[stage]
    return f"hsl({(stage * 137.5) % 360:.0f},55%,55%)"


def text_on(colour: str) -> str:
    """Dark text on light ``#rrggbb`` colours, white otherwise."""
    if len(colour) == 7 and colour.startswith("#"):
        r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
        if 0.299 * r + 0.587 * g + 0.114 * b > 165:
            return "#222"
    return "#fff"


def text_width(text: str, size: float = 11.0) -> float:
    """A generous estimate of the rendered width of ``text`` (sans-serif)."""
    return 0.62 * size * len(text)


def nice_ticks(hi: float, count: int = 6) -> list[float]:
    """Round tick values 0..>=hi (1, 2, 2.5 or 5 times a power of ten apart)."""
    if not hi > 0 or not math.isfinite(hi):
        return [0.0, 1.0]
    raw = hi / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    n = math.ceil(hi / step - 1e-9)
    return [i * step for i in range(n + 1)]


def fmt_num(x: float) -> str:
    """Axis label: :func:`sig3`."""
    return sig3(x)


def fmt_ms(x: float) -> str:
    return f"{sig3(x)} ms"


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}" '
            f'style="{FONT};font-size:11px"><title>{esc(label)}</title>' + "".join(body)
            + "</svg>")


def _text(x: float, y: float, text: str, *, anchor: str = "start", size: float = 11,
          fill: str = "#222", weight: str = "normal", halo: bool = False) -> str:
    """A label; ``halo`` draws a white outline under it so it stays readable over lines."""
    outline = ' stroke="#fff" stroke-width="3" paint-order="stroke"' if halo else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{fill}" font-weight="{weight}"{outline}>{esc(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "",
          extra: str = "") -> str:
    tip = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" '
            f'fill="{fill}" {extra}>{tip}</rect>')


def legend(items: Sequence[tuple[str, str]], x: float, y: float) -> tuple[list[str], float]:
    """Colour swatches in one row; returns the SVG parts and the row's width. A colour
    ``"hatch:#rrggbb"`` draws the swatch hatched, ``"outline"`` white with a dashed outline."""
    parts, cx = [], x
    for name, colour in items:
        if colour.startswith("hatch:"):
            parts.append(_rect(cx, y - 9, 12, 12, colour[6:], extra='rx="2"'))
            parts.append(_rect(cx, y - 9, 12, 12, f"url(#{HATCH_ID})", extra='rx="2"'))
        elif colour == "outline":
            parts.append(_rect(cx, y - 9, 12, 12, "#fff",
                               extra='rx="2" stroke="#333" stroke-dasharray="3,2"'))
        else:
            parts.append(_rect(cx, y - 9, 12, 12, colour, extra='rx="2"'))
        parts.append(_text(cx + 16, y + 1, name))
        cx += 16 + text_width(name) + 18
    return parts, cx - x


def _axis(x0: float, width: float, y_top: float, y_bottom: float, hi: float,
          unit: str, tick_format: Callable[[float], str] = fmt_num) -> list[str]:
    """Vertical grid lines with labels below ``y_bottom`` for values 0..hi."""
    parts = []
    ticks = nice_ticks(hi)
    scale = width / ticks[-1]
    for t in ticks:
        x = x0 + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{y_top:.1f}" x2="{x:.1f}" y2="{y_bottom:.1f}" '
                     'stroke="#ddd"/>')
        parts.append(_text(x, y_bottom + 14, tick_format(t), anchor="middle", fill="#555"))
    parts.append(_text(x0 + width / 2, y_bottom + 30, unit, anchor="middle", fill="#333",
                       weight="600"))
    return parts


@dataclass(frozen=True)
class Segment:
    value: float
    colour: str
    title: str = ""


def hbar_chart(
    labels: Sequence[str],
    rows: Sequence[Sequence[Segment]],
    *,
    unit: str,
    value_text: Sequence[str],
    legend_items: Sequence[tuple[str, str]] = (),
    limit: float | None = None,
    limit_label: str = "",
    tick_format: Callable[[float], str] = fmt_num,
    width: float = 1100,
    title: str = "bar chart",
    row_title: str = "",
) -> str:
    """Horizontal stacked bars, one row per label, the total written after each bar; an
    optional dashed ``limit`` line. ``unit`` titles the value axis, ``row_title`` the rows,
    ``title`` names the chart (its SVG ``<title>``)."""
    label_w = max((text_width(s) for s in [*labels, row_title]), default=0.0) + 16
    text_w = max((text_width(s) for s in value_text), default=0.0) + 12
    row_h, top = 22.0, 30.0 if legend_items or limit is not None or row_title else 8.0
    plot_w = max(width - label_w - text_w - 10, 200.0)
    totals = [sum(s.value for s in row) for row in rows]
    hi = max([*totals, limit or 0.0, 1e-12])
    scale = plot_w / nice_ticks(hi)[-1]
    bottom = top + row_h * len(rows)
    parts = _axis(label_w, plot_w, top - 4, bottom, hi, unit, tick_format) if rows else []
    if legend_items:
        parts += legend(legend_items, label_w, 14)[0]
    if row_title:
        parts.append(_text(label_w - 8, 14, row_title, anchor="end", fill="#333", weight="600"))
    texts = []
    for i, (label, row) in enumerate(zip(labels, rows)):
        y = top + i * row_h
        texts.append(_text(label_w - 8, y + 15, label, anchor="end"))
        x = label_w
        for seg in row:
            parts.append(_rect(x, y + 3, seg.value * scale, row_h - 6, seg.colour, seg.title))
            x += seg.value * scale
        texts.append(_rect(x + 3, y + 3, text_width(value_text[i]) + 4, row_h - 6, "#fff"))
        texts.append(_text(x + 6, y + 15, value_text[i], fill="#333"))
    if limit is not None:  # over the bars, under the labels (which have a white halo)
        lx = label_w + limit * scale
        parts.append(f'<line x1="{lx:.1f}" y1="{top - 6:.1f}" x2="{lx:.1f}" y2="{bottom:.1f}" '
                     'stroke="#c0392b" stroke-width="2" stroke-dasharray="6,4"/>')
        texts.append(_text(lx - 4, 14, limit_label, anchor="end", fill="#c0392b", halo=True))
    parts += texts
    return _svg(label_w + plot_w + text_w + 10, bottom + 38, parts, title)


@dataclass(frozen=True)
class Bar:
    row: int
    start: float
    end: float
    colour: str
    label: str = ""
    title: str = ""
    faint: bool = False
    hatched: bool = False


def gantt(
    rows: Sequence[str],
    bars: Sequence[Bar],
    *,
    total: float,
    unit: str = "ms",
    legend_items: Sequence[tuple[str, str]] = (),
    width: float = 1100,
    row_title: str = "device",
    title: str = "schedule Gantt chart",
) -> str:
    """One row per device, bars at their times; a bar's label is drawn when it fits.
    ``hatched`` bars get white stripes over their colour; ``faint`` ones are outlined."""
    label_w = max((text_width(s) for s in [*rows, row_title]), default=0.0) + 16
    row_h, top = 24.0, 34.0
    plot_w = max(width - label_w - 20, 300.0)
    scale = plot_w / nice_ticks(total)[-1]
    bottom = top + row_h * len(rows)
    parts = [HATCH, *_axis(label_w, plot_w, top - 4, bottom, total, f"time ({unit})")]
    parts += legend(legend_items, label_w, 16)[0]
    parts.append(_text(label_w - 8, 16, row_title, anchor="end", fill="#333", weight="600"))
    for i, name in enumerate(rows):
        y = top + i * row_h
        if i % 2:
            parts.append(_rect(label_w, y, plot_w, row_h, "#000", extra='fill-opacity="0.03"'))
        parts.append(_text(label_w - 8, y + 16, name, anchor="end"))
    for bar in bars:
        x, w = label_w + bar.start * scale, (bar.end - bar.start) * scale
        y = top + bar.row * row_h
        style = 'fill-opacity="0.6" stroke="#333" stroke-dasharray="3,2"' if bar.faint \
            else 'stroke="#fff" stroke-width="0.6"'
        parts.append(_rect(x, y + 3, w, row_h - 6, bar.colour, bar.title, style))
        if bar.hatched:
            parts.append(_rect(x, y + 3, w, row_h - 6, f"url(#{HATCH_ID})",
                               extra='pointer-events="none"'))
        if bar.label and text_width(bar.label, 10) + 4 <= w:
            parts.append(_text(x + w / 2, y + 16, bar.label, anchor="middle", size=10,
                               fill="#123" if bar.faint else "#111" if bar.hatched
                               else text_on(bar.colour),
                               halo=bar.hatched))
    end = label_w + total * scale
    parts.append(f'<line x1="{end:.1f}" y1="{top - 8:.1f}" x2="{end:.1f}" y2="{bottom:.1f}" '
                 'stroke="#333" stroke-width="1.2" stroke-dasharray="4,3"/>')
    end_text = f"end {fmt_num(total)} {unit}"
    parts.append(_text(min(end + 4, label_w + plot_w + 16 - text_width(end_text)), top - 10,
                       end_text, fill="#333", halo=True))
    return _svg(label_w + plot_w + 20, bottom + 38, parts, title)


@dataclass(frozen=True)
class DagNode:
    label: str
    title: str
    colour: str
    pill: bool = False  # graph inputs and outputs: drawn as small rounded tags


def layered_dag(
    nodes: Sequence[DagNode],
    edges: Sequence[tuple[int, int, bool]],
    *,
    legend_items: Sequence[tuple[str, str]] = (),
    max_width: float = 1300,
) -> str:
    """Nodes in topological generations (top to bottom), ordered within a layer by the mean
    position of their predecessors; ``edges`` are ``(u, v, highlighted)``."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(nodes)))
    graph.add_edges_from((u, v) for u, v, _ in edges)
    layers = [list(g) for g in nx.topological_generations(graph)]
    widest = max((len(layer) for layer in layers), default=1)
    node_h, gap_y = 24.0, 26.0
    node_w = min(96.0, max(44.0, (max_width - 40) / widest - 10))
    gap_x = 10.0
    legend_parts, legend_w = legend(legend_items, 20, 18)
    width = max(widest * (node_w + gap_x) + 40, 400.0, legend_w + 40)
    top = 40.0 if legend_items else 12.0
    pos: dict[int, tuple[float, float]] = {}
    for depth, layer in enumerate(layers):
        if depth:
            layer.sort(key=lambda v: _barycentre(graph, v, pos))
        x0 = (width - len(layer) * (node_w + gap_x) + gap_x) / 2
        for i, v in enumerate(layer):
            pos[v] = (x0 + i * (node_w + gap_x) + node_w / 2,
                      top + depth * (node_h + gap_y) + node_h / 2)
    half = [min(node_w, text_width(n.label, 10) + 14) / 2 if n.pill else node_w / 2
            for n in nodes]
    depth_of = {v: d for d, layer in enumerate(layers) for v in layer}
    right = [max(pos[v][0] + half[v] for v in layer) for layer in layers]
    lanes = _lanes([(depth_of[u], depth_of[v]) for u, v, _ in edges])
    height = top + len(layers) * (node_h + gap_y) + 4
    parts = legend_parts
    parts.append('<g fill="none" stroke-linejoin="round">')
    for (u, v, hot), lane in sorted(zip(edges, lanes), key=lambda e: e[0][2]):
        (x1, y1), (x2, y2) = pos[u], pos[v]
        stroke = 'stroke="#c0392b" stroke-width="1.6"' if hot else \
            'stroke="#8a96a3" stroke-width="1" stroke-opacity="0.8"'
        y1, y2 = y1 + node_h / 2, y2 - node_h / 2
        if lane < 0:  # neighbouring layers: an S-curve
            mid = (y2 - y1) / 2
            path = (f"M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + mid:.1f} {x2:.1f},{y2 - mid:.1f} "
                    f"{x2:.1f},{y2:.1f}")
        else:  # longer: down into the gap, right to a lane beside the layers it spans, back
            lx = max(right[depth_of[u]:depth_of[v] + 1]) + 12 + 7 * lane
            g1, g2 = y1 + 6 + 3 * (lane % 4), y2 - 6 - 3 * (lane % 4)
            width = max(width, lx + 16)
            path = (f"M{x1:.1f},{y1:.1f} V{g1:.1f} H{lx:.1f} V{g2:.1f} H{x2:.1f} V{y2:.1f}")
        parts.append(f'<path d="{path}" {stroke}/>')
    parts.append("</g>")
    for v, node in enumerate(nodes):
        x, y = pos[v]
        w = 2 * half[v]
        radius = node_h / 2 if node.pill else 4
        parts.append(_rect(x - w / 2, y - node_h / 2, w, node_h, node.colour, node.title,
                           f'rx="{radius:.0f}" stroke="#333" stroke-width="0.5"'))
        label = _fit(node.label, w - 6, 10)
        parts.append(_text(x, y + 4, label, anchor="middle", size=10,
                           fill="#222" if node.pill else text_on(node.colour)))
    return _svg(width, height, parts, "operator graph")


def _lanes(spans: Sequence[tuple[int, int]]) -> list[int]:
    """A lane per edge spanning more than one layer (-1 for the others): the smallest lane
    free of every other edge whose layer range overlaps (greedy interval colouring)."""
    lanes = [-1] * len(spans)
    busy: list[list[tuple[int, int]]] = []
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        lo, hi = spans[i]
        if hi - lo <= 1:
            continue
        k = next((k for k, taken in enumerate(busy)
                  if all(hi < a or lo > b for a, b in taken)), len(busy))
        if k == len(busy):
            busy.append([])
        busy[k].append((lo, hi))
        lanes[i] = k
    return lanes


def _barycentre(graph: nx.DiGraph, v: int, pos: dict[int, tuple[float, float]]) -> float:
    xs = [pos[u][0] for u in graph.predecessors(v) if u in pos]
    return sum(xs) / len(xs) if xs else math.inf


def _fit(text: str, width: float, size: float) -> str:
    """``text`` cut with an ellipsis to fit ``width``."""
    if text_width(text, size) <= width:
        return text
    keep = max(int(width / (0.62 * size)) - 1, 1)
    return text[:keep] + "…"


@dataclass(frozen=True)
class ColumnBox:
    stage: int
    label: str
    ops: int
    title: str


def stage_columns(
    boxes: Sequence[ColumnBox],
    edges: Sequence[tuple[int, int, bool, str]],
    *,
    max_width: float = 1300,
    shorten: Callable[[str, int], str] | None = None,
) -> str:
    """The condensed operator graph: one column per stage, left to right in stage order, each
    stage's boxes top to bottom in the order given; ``edges`` are ``(u, v, crosses a stage,
    title)``. Labels are shortened to fit their column by ``shorten(label, characters)``
    (default: cut from the left); the drawing never gets
    wider than ``max_width`` (and the page scales it down further when the window is
    narrower)."""
    stages = sorted({b.stage for b in boxes})
    column = {s: i for i, s in enumerate(stages)}
    gap, margin, box_h, gap_y, top = 28.0, 10.0, 24.0, 14.0, 26.0
    cut = shorten or _left_cut
    longest = max((text_width(f"{b.label} ({b.ops})", 10) + 16 for b in boxes), default=80.0)
    col_w = max(min(longest, 240.0, (max_width - 2 * margin) / max(len(stages), 1) - gap), 40.0)
    row: dict[int, int] = {}
    counts: dict[int, int] = {}
    for i, b in enumerate(boxes):
        row[i] = counts.get(b.stage, 0)
        counts[b.stage] = row[i] + 1
    pos = {i: (margin + column[b.stage] * (col_w + gap), top + row[i] * (box_h + gap_y))
           for i, b in enumerate(boxes)}
    width = margin * 2 + len(stages) * (col_w + gap) - gap
    height = top + max(counts.values(), default=0) * (box_h + gap_y) + 4
    parts = []
    for s in stages:
        x = margin + column[s] * (col_w + gap)
        parts.append(_text(x + col_w / 2, 16, f"stage {s}", anchor="middle", fill="#333",
                           weight="600"))
    parts.append('<g fill="none" stroke-linejoin="round">')
    for u, v, cross, title in sorted(edges, key=lambda e: e[2]):
        (x1, y1), (x2, y2) = pos[u], pos[v]
        stroke = 'stroke="#c0392b" stroke-width="1.6"' if cross else \
            'stroke="#8a96a3" stroke-width="1" stroke-opacity="0.8"'
        if cross:  # right side of the producer to the left side of the consumer
            sx, sy, ex, ey = x1 + col_w, y1 + box_h / 2, x2, y2 + box_h / 2
            mid = (ex - sx) / 2
            path = f"M{sx:.1f},{sy:.1f} C{sx + mid:.1f},{sy:.1f} {ex - mid:.1f},{ey:.1f} " \
                   f"{ex:.1f},{ey:.1f}"
        elif row[v] == row[u] + 1:  # the next box down
            path = f"M{x1 + col_w / 2:.1f},{y1 + box_h:.1f} V{y2:.1f}"
        else:  # further down: a bow inside the column's right margin
            bx = x1 + col_w + min(gap / 2 - 2, 4 + 3 * (row[v] - row[u]))
            path = (f"M{x1 + col_w:.1f},{y1 + box_h / 2:.1f} C{bx:.1f},{y1 + box_h / 2:.1f} "
                    f"{bx:.1f},{y2 + box_h / 2:.1f} {x2 + col_w:.1f},{y2 + box_h / 2:.1f}")
        parts.append(f'<path d="{path}" {stroke}><title>{esc(title)}</title></path>')
    parts.append("</g>")
    for i, b in enumerate(boxes):
        x, y = pos[i]
        colour = stage_colour(b.stage)
        parts.append(_rect(x, y, col_w, box_h, colour, b.title,
                           'rx="4" stroke="#333" stroke-width="0.5"'))
        count = f" ({b.ops})"
        room = int((col_w - 8) / (0.62 * 10)) - len(count)
        label = (cut(b.label, room) + count) if room >= 3 else _fit(b.label, col_w - 6, 10)
        parts.append(_text(x + col_w / 2, y + box_h / 2 + 4, label, anchor="middle", size=10,
                           fill=text_on(colour)))
    svg = _svg(width, height, parts, "operator graph")
    return svg.replace('style="', 'style="max-width:100%;height:auto;', 1)


def _left_cut(text: str, limit: int) -> str:
    """``text`` cut from the left with an ellipsis to at most ``limit`` characters."""
    return text if len(text) <= limit else "…" + text[len(text) - max(limit - 1, 1):]
