"""The HTML report without traps: one palette, readable numbers, every figure explained, large
graphs drawn condensed, the report beside the plan folder; and the page as Chromium shows it."""

from __future__ import annotations

import json
import re

import pytest
from support.graphs import CHAIN, save

from onnx_partition.cli import main
from onnx_partition.cost.cluster import Cluster
from onnx_partition.partition import partition
from onnx_partition.report import dag_view, default_report_path, write_report
from onnx_partition.report import page as report
from onnx_partition.report.browser import chromium, probe
from onnx_partition.report.svg import (
    _STAGE_COLOURS,
    ALLREDUCE,
    BACKWARD,
    COMM,
    FORWARD,
    stage_colour,
)
from onnx_partition.values import fmt_bytes, sig3


@pytest.fixture
def chain(tmp_path):
    return save(CHAIN, tmp_path / "m.onnx")


@pytest.fixture
def hybrid(tmp_path, chain):
    """A training plan on 2 machines x 4 'cuda' devices (planning needs no GPU)."""
    out = tmp_path / "plan"
    partition(chain, 2, out, batch_size=3, mode="train", microbatches=4,
              cluster=Cluster(machines=2, devices_per_machine=4, memory_gb=16, kind="cuda"))
    return out


@pytest.mark.parametrize(("x", "text"), [
    (236800.0, "237,000"), (11380.0, "11,400"), (45.91, "45.9"), (1.784, "1.78"),
    (0.1234, "0.123"), (0.001234, "0.00123"), (2.0, "2"), (9.996, "10"), (999.6, "1,000"),
    (0.0, "0"), (-1234.5, "-1,230"), (100.0, "100"),
])
def test_three_significant_digits_with_separators(x, text):
    assert sig3(x) == text


def test_bytes_never_in_scientific_notation():
    assert fmt_bytes(1.5e12) == "1,500 GB" and fmt_bytes(1000) == "1 kB"


def test_stages_own_the_palette():
    stage = {c.lower() for c in _STAGE_COLOURS}
    assert not {FORWARD.lower(), BACKWARD.lower(), ALLREDUCE.lower(), COMM.lower()} & stage


def test_report_page_items(hybrid):
    path = write_report(hybrid)
    assert path == default_report_path(hybrid) == hybrid.parent / "plan.report.html"
    page = path.read_text()
    text = re.sub(r"<[^>]+>", " ", page)
    assert not re.search(r"\d(\.\d+)?e[+-]\d", text), "scientific notation on the page"
    # one palette: a stage's forward and backward bars are both in the stage's colour,
    # backward hatched on top
    plan = json.loads((hybrid / "plan.json").read_text())
    for stage in range(len(plan["stages"])):
        fills = re.findall(r'fill="(#[0-9a-f]{6})"[^>]*><title>[^<]*stage '
                           rf'{stage} (?:forward|backward) of', page)
        assert fills and set(fills) == {stage_colour(stage)}
    assert page.count('fill="url(#op-hatch)"') >= 1
    # the header says which devices and which costs
    header = page.split("<header>", 1)[1].split("</header>", 1)[0]
    assert "cuda" in header and "2 machines × 4" in header and "16 GB each" in header
    assert "analytic roofline model" in header
    # every figure says what it is; the bottleneck is explained next to the stage times
    assert "÷ replicas" in page and "global batch = micro-batch size 3 x 4 micro-batches" in page
    assert "can be higher" not in page
    # devices in full, never cut with an ellipsis
    for stage in plan["stages"]:
        assert ", ".join(stage["devices"]) in page
    assert "copied consts" in page and "Copied consts: constant nodes copied" in page


def test_repartitioning_keeps_the_report(tmp_path, chain, capsys):
    out = tmp_path / "plan"
    argv = ["partition", str(chain), "-s", "2", "--batch-size", "2", "-o", str(out)]
    assert main(argv) == 0
    assert main(["report", str(out)]) == 0
    assert f"wrote {tmp_path / 'plan.report.html'}" in capsys.readouterr().out
    assert main(argv) == 0  # the same folder again
    assert (tmp_path / "plan.report.html").is_file()


def test_block_of_uses_module_scopes_and_paths():
    assert dag_view.block_of("n1", ["", "blocks.3", "blocks.3.attn", "view_10"]) == "blocks.3"
    assert dag_view.block_of("n2", ["", "encoder", "encoder.layers.0", "x"]) == \
        "encoder.layers.0"
    assert dag_view.block_of("n3", ["", "ln_f", "layer_norm"]) == "ln_f"
    assert dag_view.block_of("n4", ["", "embedding"]) == dag_view.TOP
    assert dag_view.block_of("/layer2/layer2.1/conv1/Conv", []) == "layer2.layer2.1"
    assert dag_view.block_of("plain", []) == dag_view.TOP


@pytest.mark.parametrize("engine", ["graphviz dot", "built-in column layout"])
def test_large_graphs_are_drawn_condensed(tmp_path, chain, monkeypatch, engine):
    if engine == "graphviz dot" and not dag_view.graphviz_available():
        pytest.skip("graphviz (package and dot) not installed")
    if engine != "graphviz dot":
        monkeypatch.setattr(dag_view, "graphviz_available", lambda: False)
    monkeypatch.setattr(report, "MAX_DAG_NODES", 2)
    out = tmp_path / "plan"
    partition(chain, 2, out, batch_size=2)
    page = write_report(out).read_text()
    assert "Not drawn" not in page and f"Drawn with {engine}" in page
    assert "condensed to 2 boxes" in page  # one block per stage for a flat graph
    assert 'aria-label="operator graph"' in page
    if engine == "graphviz dot":
        assert "<title>operator graph, condensed</title>" in page
        assert re.search(r">\d+ B</text>", page)  # the cut edge labelled with its bytes


# ------------------------------------------------------------------------ in a real browser

needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium is not installed")


@needs_chromium
def test_report_in_headless_chromium(hybrid):
    verdict = probe(write_report(hybrid))
    assert verdict["errors"] == [] and verdict["console"] == []
    assert verdict["scientific"] == []
    svgs = verdict["svgs"]
    assert len(svgs) == 4
    for svg in svgs:
        assert svg["title"], svg["label"]
        assert svg["outside"] == [], (svg["label"], svg["outside"])
        if svg["label"] != "operator graph":  # charts: axis titles with units, row titles
            assert any(re.search(r"\((ms|bytes)\)", t) for t in svg["texts"]), svg["texts"]
            assert any(t in ("stage", "stage · replica · device") for t in svg["texts"])
            assert re.search(r"\((ms|bytes)\)", svg["title"]), svg["title"]


@needs_chromium
def test_the_browser_check_sees_errors(hybrid, tmp_path):
    broken = tmp_path / "broken.html"
    page = write_report(hybrid).read_text()
    broken.write_text(page.replace("</main>", '<img src="missing.png" alt=""></main>'))
    assert any("missing.png" in e for e in probe(broken)["errors"])


def test_headline_in_samples_and_tokens_per_second(tmp_path, chain):
    import dataclasses

    from onnx_partition.plan import read_plan

    out = tmp_path / "plan"
    partition(chain, 1, out, batch_size=3)
    plan = read_plan(out)
    rate = 1000.0 / 7  # micro-batches/s
    cards = [v for v, _ in report.throughput_cards(plan, rate)]
    assert cards == ["429 samples/s", "143 micro-batches/s"]  # a float input: no tokens
    assert report.tokens_per_sample(plan) is None
    plan.inputs[0] = dataclasses.replace(plan.inputs[0], dtype="int64", shape=["batch", 16])
    assert report.tokens_per_sample(plan) == 4  # the length partitioned for (3 x 4)
    assert [v for v, _ in report.throughput_cards(plan, rate)] == [
        "429 samples/s", "1,710 tokens/s", "143 micro-batches/s"]
    page = write_report(out).read_text()
    header = page.split("<header>", 1)[1].split("</header>", 1)[0]
    assert "1 stage ·" in header and "1 stages" not in page
    cards_html = page.split('<div class="cards">', 1)[1]
    assert cards_html.index("samples/s") < cards_html.index("micro-batches/s")
