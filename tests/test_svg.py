"""The report's hand-drawn SVG (:mod:`onnx_partition.report.svg`): well-formed XML, the numbers it
shows, where it draws them, and names with ``<&>"'`` escaped."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnx_partition.report.svg import (
    HATCH_ID,
    Bar,
    DagNode,
    Segment,
    esc,
    gantt,
    hbar_chart,
    layered_dag,
    nice_ticks,
    stage_colour,
    text_on,
)
from onnx_partition.values import fmt_bytes

NS = "{http://www.w3.org/2000/svg}"
NASTY = "a<b>&c\"d'e"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg"
    return root


def texts(root: ET.Element) -> list[str]:
    """The ``<text>`` labels, in document order."""
    return [t.text or "" for t in root.iter(f"{NS}text")]


def rects(root: ET.Element) -> list[ET.Element]:
    return list(root.iter(f"{NS}rect"))


def tip(element: ET.Element) -> str | None:
    title = element.find(f"{NS}title")
    return None if title is None else title.text


def test_esc_escapes_markup_and_quotes() -> None:
    assert esc(NASTY) == "a&lt;b&gt;&amp;c&quot;d&#x27;e"
    assert esc(3.5) == "3.5"


@pytest.mark.parametrize(("hi", "ticks"), [
    (7, [0, 2, 4, 6, 8]), (100, [0, 20, 40, 60, 80, 100]),
    (1234, [0, 250, 500, 750, 1000, 1250]),
    (0, [0, 1]), (-3, [0, 1]), (float("inf"), [0, 1]), (float("nan"), [0, 1]),
])
def test_nice_ticks_exact(hi: float, ticks: list[float]) -> None:
    assert nice_ticks(hi) == pytest.approx(ticks)


@given(st.floats(1e-6, 1e12))
def test_nice_ticks_cover_the_range_in_round_steps(hi: float) -> None:
    ticks = nice_ticks(hi)
    step = ticks[1]
    assert 3 <= len(ticks) <= 6 and ticks[0] == 0 and ticks[-2] < hi <= ticks[-1] * (1 + 1e-9)
    assert ticks == pytest.approx([i * step for i in range(len(ticks))])
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 2.5, 5, 10)) < 1e-6


def test_formats_and_colours_exact() -> None:
    assert [fmt_bytes(n) for n in (999, 1000, 2.5e6, 3e9)] == ["999 B", "1 kB", "2.5 MB", "3 GB"]
    assert [stage_colour(k) for k in (0, 9, 10)] == ["#4e79a7", "#6f4e7c", "hsl(295,55%,55%)"]
    assert [text_on(c) for c in ("#ffffff", "#4e79a7", "#edc948", "hsl(1,2%,3%)")] == [
        "#222", "#fff", "#222", "#fff"]


# ------------------------------------------------------------------------------ bar chart


def test_hbar_chart_bars_are_to_scale_with_their_totals_written() -> None:
    svg = hbar_chart(
        [NASTY, "stage 1"],
        [[Segment(3.0, "#111111", "fwd <3>"), Segment(1.0, "#222222")], [Segment(8.0, "#333333")]],
        unit="time (ms)", value_text=["4 ms", "8 ms"], limit=6.0, limit_label="limit & more",
        title="chart <1>", row_title="stage")
    root = parse(svg)
    assert tip(root) == "chart <1>" and root.get("aria-label") == "chart <1>"
    labels = texts(root)
    for wanted in (NASTY, "stage 1", "4 ms", "8 ms", "limit & more", "time (ms)", "stage"):
        assert wanted in labels
    assert [t for t in labels if t.replace(".", "").isdigit()] == ["0", "2", "4", "6", "8"]
    bars = {r.get("fill"): r for r in rects(root)}
    width = {c: float(bars[c].get("width") or 0) for c in ("#111111", "#222222", "#333333")}
    assert width["#111111"] / 3 == pytest.approx(width["#222222"], abs=0.01)
    assert width["#333333"] / 8 == pytest.approx(width["#222222"], abs=0.01)
    assert tip(bars["#111111"]) == "fwd <3>"
    # the second segment starts where the first ends; the limit line sits at 6 of 8
    x0 = float(bars["#111111"].get("x") or 0)
    assert float(bars["#222222"].get("x") or 0) == pytest.approx(x0 + width["#111111"], abs=0.01)
    line = next(e for e in root.iter(f"{NS}line") if e.get("stroke") == "#c0392b")
    assert float(line.get("x1") or 0) == pytest.approx(x0 + 6 / 8 * width["#333333"], abs=0.1)


def test_hbar_chart_of_no_rows_is_still_an_svg() -> None:
    root = parse(hbar_chart([], [], unit="ms", value_text=[]))
    assert texts(root) == [] and rects(root) == []


@given(st.lists(st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12),
                min_size=1, max_size=4),
       st.floats(0, 1e6))
def test_any_label_survives_as_text(labels: list[str], value: float) -> None:
    svg = hbar_chart(labels, [[Segment(value, "#123456", label)] for label in labels],
                     unit="u", value_text=labels, title=labels[0])
    root = parse(svg)
    assert tip(root) == (labels[0] or None)
    shown = texts(root)
    for label in labels:
        assert shown.count(label) >= 2  # row label and value text


# ------------------------------------------------------------------------------ Gantt


def test_gantt_places_bars_in_time_and_labels_those_that_fit() -> None:
    bars = [Bar(0, 0.0, 5.0, "#4e79a7", "F0", "forward <0>"),
            Bar(1, 5.0, 10.0, "#f28e2b", "B0", hatched=True),
            Bar(0, 5.0, 5.01, "#59a14f", "too long to fit"),
            Bar(1, 0.0, 2.0, "#e15759", "", faint=True)]
    root = parse(gantt(["dev <0>", "dev 1"], bars, total=10.0, title="g & t"))
    assert tip(root) == "g & t"
    labels = texts(root)
    assert {"dev <0>", "dev 1", "F0", "B0", "end 10 ms", "time (ms)", "device"} <= set(labels)
    assert "too long to fit" not in labels
    drawn = {r.get("fill"): r for r in rects(root)}
    f0, b0 = drawn["#4e79a7"], drawn["#f28e2b"]
    assert tip(f0) == "forward <0>"
    assert float(f0.get("width") or 0) == pytest.approx(float(b0.get("width") or 0))
    assert float(b0.get("x") or 0) == pytest.approx(
        float(f0.get("x") or 0) + float(f0.get("width") or 0))
    assert float(b0.get("y") or 0) - float(f0.get("y") or 0) == 24.0  # one row down
    hatches = [r for r in rects(root) if r.get("fill") == f"url(#{HATCH_ID})"]
    assert [(h.get("x"), h.get("width")) for h in hatches] == [(b0.get("x"), b0.get("width"))]
    assert drawn["#e15759"].get("stroke-dasharray") == "3,2"  # faint: dashed outline
    assert root.find(f".//{NS}pattern[@id='{HATCH_ID}']") is not None


# ------------------------------------------------------------------------------ DAG


def centre(root: ET.Element, title: str) -> tuple[float, float]:
    box = next(r for r in rects(root) if tip(r) == title)
    return (float(box.get("x") or 0) + float(box.get("width") or 0) / 2,
            float(box.get("y") or 0) + float(box.get("height") or 0) / 2)


def test_layered_dag_draws_generations_top_down_and_long_edges_in_lanes() -> None:
    # 0 -> 1 -> 2 -> 3 and 0 -> 3 (spans three layers: a lane); 0 -> 1 highlighted
    nodes = [DagNode("x", "input <x>", "#ffffff", pill=True),
             DagNode("mm", "MatMul & co", "#4e79a7"), DagNode("relu", "Relu", "#4e79a7"),
             DagNode("y", "output", "#ffffff", pill=True)]
    edges = [(0, 1, True), (1, 2, False), (2, 3, False), (0, 3, False)]
    root = parse(layered_dag(nodes, edges, legend_items=[("stage <0>", "#4e79a7")]))
    assert tip(root) == "operator graph"
    assert {"x", "mm", "relu", "y", "stage <0>"} <= set(texts(root))
    ys = [centre(root, n.title)[1] for n in nodes]
    assert ys == sorted(ys) and len(set(ys)) == 4
    assert [y - ys[0] for y in ys] == pytest.approx([0, 50, 100, 150])  # node 24 + gap 26
    paths = [p.get("d") or "" for p in root.iter(f"{NS}path")]
    assert len(paths) == 4
    assert sum(" H" in d for d in paths) == 1  # only the long edge leaves the S-curves
    hot = [p for p in root.iter(f"{NS}path") if p.get("stroke") == "#c0392b"]
    assert len(hot) == 1 and paths[-1] == hot[0].get("d")  # drawn last, on top


def test_a_long_label_is_cut_with_an_ellipsis() -> None:
    root = parse(layered_dag([DagNode("a" * 40, "t", "#4e79a7")], []))
    label = next(t for t in texts(root) if t.startswith("a"))
    assert label.endswith("…") and len(label) < 40
