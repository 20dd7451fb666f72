"""Simulating a written plan from plan.json alone, and the self-contained HTML report."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from typing import ClassVar

import pytest
from support.graphs import CHAIN, save

from onnx_partition.cli.summary.partition import plan_table
from onnx_partition.cli.summary.simulate import format_simulation
from onnx_partition.cost.cluster import Cluster
from onnx_partition.errors import PartitionError
from onnx_partition.partition import Link, partition
from onnx_partition.pipeline.from_plan import (
    played_comm,
    schedule_name,
    send_times,
    simulate_plan,
)
from onnx_partition.pipeline.predict import simulation_json
from onnx_partition.pipeline.simulate import (
    bubble_closed_form,
    bubble_closed_form_interleaved,
    pipeline_time_closed_form,
)
from onnx_partition.plan import read_plan
from onnx_partition.report import write_report
from onnx_partition.report.charts import time_chart
from onnx_partition.report.page import report_figures, report_html

CHAIN_NODES = ("a", "b", "d", "e", "f", "y")  # the cut (non-constant) nodes of CHAIN


@pytest.fixture
def chain(tmp_path):
    return save(CHAIN, tmp_path / "m.onnx")


def unit_costs(tmp_path, backward_ms: float = 2.0):
    """costs.json: every operator 1 ms forward, ``backward_ms`` backward."""
    path = tmp_path / "costs.json"
    nodes = {k: {"forward_ms": 1.0, "backward_ms": backward_ms} for k in CHAIN_NODES}
    path.write_text(json.dumps({"format": "onnx-partition/costs@1", "unit": "ms",
                                "nodes": nodes}))
    return path


# ------------------------------------------------------------------------- simulate_plan


def test_send_times_split_each_boundary_between_its_neighbours():
    assert send_times([]) == [] and send_times([0.7]) == []
    assert send_times([0.5, 1.0, 0.5]) == pytest.approx([0.5, 0.5])
    assert send_times([1.0, 3.0, 2.0]) == pytest.approx([1.0, 2.0])
    assert send_times([2.0, 6.0, 4.0], factor=2.0) == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize("microbatches", [1, 4, 8])
def test_plain_pipeline_equal_stages_matches_closed_form(tmp_path, chain, microbatches):
    # 6 operators of 1 ms in 3 stages, free links: three equal 2 ms stages
    plan = partition(chain, 3, tmp_path / "out", batch_size=3, costs=unit_costs(tmp_path),
                     link=Link(bandwidth_gbps=0, latency_ms=0.0))
    assert [s.predicted.compute_ms for s in plan.stages] == [2.0, 2.0, 2.0]
    result, costs = simulate_plan(plan, microbatches=microbatches)
    assert costs.send_ms == [0.0, 0.0]
    assert all(s.backward_ms == 0.0 for s in costs.stages)
    assert result.iteration_ms == pytest.approx(pipeline_time_closed_form(2.0, 3, microbatches))
    assert result.bubble_fraction == pytest.approx(bubble_closed_form(3, microbatches))
    assert result.throughput_per_s == pytest.approx(microbatches / result.iteration_ms * 1000)
    assert not any(a.kind.value == "B" for _, a, _, _ in result.timeline)


def test_plain_pipeline_sends_come_from_the_per_stage_comm(tmp_path, chain):
    # latency 0.5 ms per boundary, infinite bandwidth: comm = [0.5, 1.0, 0.5]
    plan = partition(chain, 3, tmp_path / "out", batch_size=3, costs=unit_costs(tmp_path),
                     link=Link(bandwidth_gbps=0, latency_ms=0.5))
    assert [s.predicted.comm_ms for s in plan.stages] == [0.5, 1.0, 0.5]
    result, costs = simulate_plan(plan)
    assert costs.send_ms == pytest.approx([0.5, 0.5])
    # equal stages, sends overlapping compute: the fill pays each send once
    assert result.iteration_ms == pytest.approx(pipeline_time_closed_form(2.0, 3, 8) + 1.0)


@pytest.mark.parametrize("num_stages", [None, 2, 3])
def test_hybrid_plan_reproduces_the_planners_simulation(tmp_path, chain, num_stages):
    # backward = 2 x forward everywhere: the forward/backward split plan.json loses is exact
    out = tmp_path / "out"
    plan = partition(chain, num_stages, out, batch_size=3, costs=unit_costs(tmp_path),
                     cluster=Cluster(devices_per_machine=4), mode="train")
    result, costs = simulate_plan(read_plan(out))
    assert result.iteration_ms == pytest.approx(plan.predicted["iteration_ms"], abs=1e-5)
    assert result.bubble_fraction == pytest.approx(plan.predicted["bubble_fraction"], abs=1e-3)
    assert [s.replicas for s in costs.stages] == [s.replicas for s in plan.stages]
    assert [s.allreduce_ms for s in costs.stages] == plan.extra["allreduce_ms"]
    num_mb = plan.predicted["microbatches"]
    assert {a.microbatch for _, a, _, _ in result.timeline} == set(range(num_mb))
    assert any(a.kind.value == "B" for _, a, _, _ in result.timeline)
    if len(plan.stages) > 1:
        # train comm = 2 x (send in + send out): forward activation and backward gradient
        comm = [s.predicted.comm_ms for s in plan.stages]
        s = [0.0, *costs.send_ms, 0.0]
        assert comm == pytest.approx([2 * (s[k] + s[k + 1]) for k in range(len(comm))],
                                     abs=1e-5)


def test_hybrid_plan_with_analytic_costs_is_close(tmp_path, chain):
    # analytic backward/forward ratios differ per operator: the 2:1 split is an estimate
    plan = partition(chain, 3, tmp_path / "out", batch_size=3,
                     cluster=Cluster(devices_per_machine=4), mode="train")
    result, _ = simulate_plan(plan)
    assert result.iteration_ms == pytest.approx(plan.predicted["iteration_ms"], rel=0.05)


def test_exact_simulator_costs_in_the_plan_are_used(tmp_path, chain):
    plan = partition(chain, 2, tmp_path / "out", batch_size=3,
                     cluster=Cluster(devices_per_machine=2), mode="train")
    plan.extra["simulator_costs"] = {"forward_ms": [1.0, 1.0], "backward_ms": [1.0, 1.0],
                                     "send_ms": [0.0]}
    _, costs = simulate_plan(plan)
    assert [(s.forward_ms, s.backward_ms) for s in costs.stages] == [(1.0, 1.0)] * 2
    assert costs.send_ms == [0.0]
    plan.extra["simulator_costs"] = {"forward_ms": [1.0]}
    with pytest.raises(PartitionError, match="forward_ms"):
        simulate_plan(plan)


def test_schedule_and_microbatch_overrides(tmp_path, chain):
    plan = partition(chain, 2, tmp_path / "out", batch_size=3, costs=unit_costs(tmp_path),
                     cluster=Cluster(devices_per_machine=2), mode="train")
    one_f_one_b, _ = simulate_plan(plan)
    gpipe, _ = simulate_plan(plan, schedule="gpipe")
    # GPipe stashes every micro-batch; 1F1B at most the pipeline depth
    assert max(gpipe.peak_inflight.values()) == plan.predicted["microbatches"]
    assert max(one_f_one_b.peak_inflight.values()) <= 2
    forward_only, costs = simulate_plan(plan, schedule="infer", microbatches=3)
    assert {a.microbatch for _, a, _, _ in forward_only.timeline} == {0, 1, 2}
    assert all(a.kind.value == "F" for _, a, _, _ in forward_only.timeline)
    assert [s.forward_ms for s in costs.stages] == pytest.approx([3.0, 3.0])  # 9 ms = 3 + 6
    with pytest.raises(PartitionError, match="unknown schedule"):
        simulate_plan(plan, schedule="zigzag")
    with pytest.raises(PartitionError, match="micro-batch"):
        simulate_plan(plan, microbatches=0)


def test_format_simulation(tmp_path, chain):
    plan = partition(chain, 2, tmp_path / "out", batch_size=3,
                     cluster=Cluster(devices_per_machine=4), mode="train")
    result, _ = simulate_plan(plan)
    text = format_simulation(plan, result)
    assert "iteration" in text and "bubble" in text and "micro-batches/s" in text
    for dev in result.busy_ms:
        assert f"stage {dev[0]} replica {dev[1]}" in text
    # the schedule grid: the plan's schedule (the planner chooses 1F1B or ZB-H1 by the
    # simulated iteration, which the machine's measured CPU speed can tip either way)
    backward = "0I0" if schedule_name(result) == "zb-h1" else "0B0"
    assert "0F0" in text and backward in text
    big, _ = simulate_plan(plan, microbatches=200)
    assert "grid left out" in format_simulation(plan, big)


def test_interleaved_what_if_on_a_plain_plan(tmp_path, chain):
    # 6 stages of 1 ms, free links; an inference plan under a training schedule gets
    # backward = 2 x forward (as 1F1B does): p = 3 devices of v = 2 equal chunks
    plan = partition(chain, 6, tmp_path / "out", batch_size=3, costs=unit_costs(tmp_path),
                     link=Link(bandwidth_gbps=0, latency_ms=0.0))
    result, costs = simulate_plan(plan, schedule="interleaved", microbatches=6)
    assert [(s.forward_ms, s.backward_ms) for s in costs.stages] == [(1.0, 2.0)] * 6
    assert sorted(result.busy_ms) == [(0, 0), (1, 0), (2, 0)]
    assert result.iteration_ms == pytest.approx((6 + (3 - 1) / 2) * 2 * 3.0)
    assert result.bubble_fraction == pytest.approx(bubble_closed_form_interleaved(3, 6, 2))
    one_f_one_b, _ = simulate_plan(plan, schedule="1f1b", microbatches=6)
    assert sorted(one_f_one_b.busy_ms) == [(s, 0) for s in range(6)]
    three, _ = simulate_plan(plan, schedule="interleaved", chunks=3, microbatches=4)
    assert sorted(three.busy_ms) == [(0, 0), (1, 0)]
    assert three.bubble_fraction == pytest.approx(bubble_closed_form_interleaved(2, 4, 3))
    text = format_simulation(plan, result)
    assert "interleaved what-if: 6 stages on 3 devices per replica, 2 model chunks" in text
    assert "device 0 replica 0 (stages 0, 3)" in text and "device 2 replica 0 (stages 2, 5)" in text
    assert "stage 0 replica 0" not in text  # plan.json's devices are for the 6-device layout
    assert "3F0" in text and "3B0" in text  # the schedule grid
    assert "what-if" not in format_simulation(plan, one_f_one_b)


def test_interleaved_rejects_what_the_plan_does_not_allow(tmp_path, chain):
    plan = partition(chain, 4, tmp_path / "out", batch_size=3)
    with pytest.raises(PartitionError, match="chunk count must divide the stage count"):
        simulate_plan(plan, schedule="interleaved", chunks=3)
    with pytest.raises(PartitionError, match="multiples of 2 devices = 2, got 3"):
        simulate_plan(plan, schedule="interleaved", microbatches=3)
    with pytest.raises(PartitionError, match="only to the interleaved schedule, not 1f1b"):
        simulate_plan(plan, schedule="1f1b", chunks=2)
    plan.stages[1].replicas = 2
    with pytest.raises(PartitionError, match="same replica count in every stage"):
        simulate_plan(plan, schedule="interleaved")
    one, _ = simulate_plan(plan, schedule="interleaved", chunks=1)  # 1F1B: replicas allowed
    assert sorted(one.busy_ms) == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]


# ------------------------------------------------------------------------------ report


class Page(HTMLParser):
    """Tags and text of a page, checking that non-void elements nest properly."""

    VOID: ClassVar[frozenset[str]] = frozenset({"meta", "br", "img", "hr", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    assert not page.errors, page.errors[:5]
    assert page.stack == [], page.stack
    return page


def test_report_for_a_hybrid_plan(tmp_path, chain):
    out = tmp_path / "out"
    plan = partition(chain, 3, out, batch_size=3,
                     cluster=Cluster(devices_per_machine=4, memory_gb=1e-6), mode="train")
    path = write_report(out)
    assert path == tmp_path / "out.report.html"  # beside the plan folder, not in it
    page = parse(path)
    text = " ".join(page.text)
    svgs = [a for t, a in page.tags if t == "svg"]
    labels = {a.get("aria-label") for a in svgs}
    assert "operator graph" in labels and len(svgs) == 4
    assert any(label.startswith("schedule Gantt chart") for label in labels)
    for stage in plan.stages:
        assert f"stage {stage.index}" in text
    assert "device limit 1 kB" in text  # memory against the cluster's limit
    # Gantt: every forward/backward as a bar with its tooltip, plus all-reduce windows
    result, _ = simulate_plan(plan)
    assert text.count("forward of micro-batch") == sum(
        a.kind.value == "F" for _, a, _, _ in result.timeline)
    assert text.count("backward of micro-batch") == sum(
        a.kind.value == "B" for _, a, _, _ in result.timeline)
    assert ("gradient all-reduce" in text) == bool(result.allreduce)
    # DAG: one box per operator, named in its tooltip
    for key in CHAIN_NODES:
        assert f"{key} (" in text
    # self-contained: no scripts, no external references
    assert not any(t in ("script", "link", "img", "iframe") for t, _ in page.tags)
    assert not any((a.get("src") or a.get("href")) for _, a in page.tags)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["plan.json", *(s.file for s in plan.stages)])


def test_report_without_the_model_still_written(tmp_path, chain):
    out = tmp_path / "out"
    partition(chain, 2, out, batch_size=3)
    chain.unlink()
    target = tmp_path / "elsewhere.html"
    assert write_report(out, target) == target
    page = parse(target)
    text = " ".join(page.text)
    assert "model file ../m.onnx was not found" in text
    assert sum(t == "svg" for t, _ in page.tags) == 3  # no graph, the rest is there
    assert "schedule Gantt chart" in target.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.html", "out"]


def test_report_escapes_text_and_replaces_atomically(tmp_path, chain):
    out = tmp_path / "out"
    partition(chain, 2, out, batch_size=3)
    body = json.loads((out / "plan.json").read_text())
    body["stages"][0]["devices"] = ["<b>cpu&</b>"]
    (out / "plan.json").write_text(json.dumps(body))
    (tmp_path / "out.report.html").write_text("old")
    with pytest.raises(PartitionError, match="exists; use --force"):
        write_report(out)  # not a report of ours
    path = write_report(out, force=True)
    assert write_report(out) == path  # an earlier report is replaced without --force
    html = path.read_text()
    assert "<b>cpu" not in html and "&lt;b&gt;cpu&amp;&lt;/b&gt;" in html
    parse(path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_report_errors(tmp_path):
    with pytest.raises(PartitionError, match="not a plan folder"):
        write_report(tmp_path)


def test_report_of_an_interleaved_hybrid_plan(tmp_path, chain):
    out = tmp_path / "out"
    partition(chain, 2, out, batch_size=3, cluster=Cluster(devices_per_machine=4), mode="train")
    body = json.loads((out / "plan.json").read_text())  # pin 2 x 2, whatever the planner chose
    for stage in body["stages"]:
        stage["replicas"], stage["devices"] = 2, ["cpu:0", "cpu:1"]
    body["allreduce_ms"] = [0.04, 0.04]
    (out / "plan.json").write_text(json.dumps(body))
    plan = read_plan(out)
    result, _ = simulate_plan(plan, schedule="interleaved", chunks=2)
    assert sorted(result.busy_ms) == [(0, 0), (0, 1)]  # both stages on each device
    assert set(result.allreduce) == {0, 1}
    page = parse(write_report(out, schedule="interleaved", chunks=2))
    text = " ".join(page.text)
    for r in (0, 1):
        assert f"device 0 · replica {r} · stages 0, 1" in text
    assert "Interleaved what-if: 2 stages on 1 device per replica" in text
    assert text.count("forward of micro-batch") == len(result.timeline) // 2
    assert text.count("gradient all-reduce, ") == 4  # 2 stages x 2 replicas
    with pytest.raises(PartitionError, match="multiples of 1 device x 2 replicas = 2, got 3"):
        write_report(out, schedule="interleaved", microbatches=3)


def test_train_table_shows_the_hops_the_simulation_plays(tmp_path, chain):
    """A plain train pipeline's planner counts each boundary once (latency 0.5 ms: comm
    [0.5, 1.0, 0.5]); its simulation plays each hop twice per micro-batch (the activation
    forward, the gradient back): [1, 2, 1], shown beside it as ``comm ms (played)`` in the
    table, the report's table and time chart and ``simulate --json``. A hybrid train plan's
    comm already counts both ways: one column."""
    plan = partition(chain, 3, tmp_path / "out", batch_size=3, costs=unit_costs(tmp_path),
                     link=Link(bandwidth_gbps=0, latency_ms=0.5), mode="train")
    assert [s.predicted.comm_ms for s in plan.stages] == [0.5, 1.0, 0.5]
    assert played_comm(plan) == pytest.approx([1.0, 2.0, 1.0])
    table = plan_table(plan).splitlines()
    assert "compute ms  comm ms  comm ms (played)  total ms" in table[0]
    assert [row.split()[3:7] for row in table[2:5]] == [
        ["6.000", "0.500", "1.000", "6.500"], ["6.000", "1.000", "2.000", "7.000"],
        ["6.000", "0.500", "1.000", "6.500"]]
    assert "comm (played): the same boundaries as the simulated iteration plays them" in \
        plan_table(plan)
    assert "simulator_costs.send_ms (the plan's link model)." in plan_table(plan)
    result, costs = simulate_plan(plan)
    page = report_html(plan, tmp_path / "out", result, costs)
    assert '<th class="">comm ms (played)</th>' in page
    assert "Comm: the link model the cut was balanced on" in page
    assert "<td>6</td><td>0.5</td><td>1</td><td>6.5</td>" in page  # stage 0
    assert "6 + 2 = 8 ms" in time_chart(plan)  # stage 1's compute + played comm
    figures = report_figures(page)
    assert [s["comm_played_ms"] for s in figures["stages"]] == [1.0, 2.0, 1.0]
    # forward only (run's prediction): no played field (each hop once, as comm_ms)
    forward = simulation_json(plan, simulate_plan(plan, schedule="infer")[0], schedule="infer",
                              microbatches=8, batch_size=3)
    assert all("comm_played_ms" not in s for s in forward["stages"])
    hybrid = partition(chain, 3, tmp_path / "hybrid", batch_size=3, costs=unit_costs(tmp_path),
                       cluster=Cluster(devices_per_machine=4), mode="train")
    assert played_comm(hybrid) is None and "(played)" not in plan_table(hybrid)
    assert "(played)" not in time_chart(hybrid)
    infer = partition(chain, 3, tmp_path / "infer", batch_size=3, costs=unit_costs(tmp_path),
                      link=Link(bandwidth_gbps=0, latency_ms=0.5))
    assert played_comm(infer) is None and "(played)" not in plan_table(infer)


def _stage_memory(page: str) -> tuple[str, list[str]]:
    """The stage table's memory column of a report page: its header and one cell per stage."""
    import re

    table = page[page.index("<h2>Stages</h2>"):]
    table = table[:table.index("</table>")]
    head = [re.sub("<[^>]+>", "", h) for h in re.findall(r"<th[^>]*>(.*?)</th>", table)]
    col = next(i for i, h in enumerate(head) if h.startswith("memory"))
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in table.split("<tr")[2:]]
    return head[col], [row[col] for row in rows]


def test_what_if_report_shows_the_memory_of_the_schedule_it_simulates(tmp_path, chain, capsys):
    """report --schedule gpipe of a 1F1B train plan: GPipe holds all 8 micro-batches, so each
    stage's memory is static + 8 x stash (2496 B and 3328 B, not the plan's 960 B and 640 B),
    over a limit the 1F1B plan fits, and the page carries simulate's warning; --microbatches 1
    holds one (704 B, 640 B). The planned report keeps plan.json's figures and no warning."""
    from onnx_partition.pipeline.from_plan import over_memory_note
    from onnx_partition.pipeline.memory import device_bytes, peak_inflight
    from onnx_partition.values import fmt_bytes

    out = tmp_path / "plan"
    partition(chain, 2, out, batch_size=4, mode="train", schedule="1f1b", recompute="none",
              cluster=Cluster(devices_per_machine=2))
    body = json.loads((out / "plan.json").read_text())
    body["cluster"]["memory_gb"] = 2000 / 1e9  # 1F1B fits, GPipe does not
    (out / "plan.json").write_text(json.dumps(body))
    plan = read_plan(out)
    sim = plan.simulator_costs
    replicas = [s.replicas for s in plan.stages]
    assert replicas == [1, 1] and plan.microbatches == 8

    def closed_form(schedule: str, m: int) -> tuple[list[float], list[int]]:
        held = peak_inflight(schedule, replicas, m)
        return [device_bytes(st, stash, h) for st, stash, h in
                zip(sim["static_bytes"], sim["activation_bytes"], held, strict=True)], held

    planned = [s.predicted.memory_bytes for s in plan.stages]
    assert closed_form("1f1b", 8)[0] == planned == [960, 640]
    cases = {("gpipe", None): ([2496, 3328], [8, 8]), ("1f1b", 1): ([704, 640], [1, 1])}
    for (schedule, m), (want, held) in cases.items():
        assert closed_form(schedule, m or 8) == (want, held)
        said: list[str] = []
        path = write_report(out, tmp_path / f"{schedule}.html", schedule=schedule,
                            microbatches=m, warn=said.append)
        page = path.read_text()
        text = " ".join(parse(path).text)
        header, cells = _stage_memory(page)
        assert header == f"memory ({schedule})" and cells == [fmt_bytes(b) for b in want]
        for b, h in zip(want, held, strict=True):
            assert f"{fmt_bytes(b)}, {h} in flight ({b / 20:.3g}% of limit)" in text
        assert f"memory per device under {schedule}, {m or 8} micro-batch" in text
        warning = over_memory_note(plan, simulate_plan(plan, schedule=schedule,
                                                       microbatches=m)[0])
        assert (warning is not None) == (schedule == "gpipe")
        assert said == ([warning] if warning else [])  # the command line prints it on stderr
        assert text.count("warning: ") == (2 if warning else 0)  # the top and the chart
        if warning:
            assert warning in text and warning.endswith("the plan was made for 1f1b")
    from onnx_partition.cli import main

    assert main(["report", str(out), "--schedule", "gpipe", "-o", str(tmp_path / "c.html"),
                 "-q"]) == 0
    gpipe_note = over_memory_note(plan, simulate_plan(plan, schedule="gpipe")[0])
    assert gpipe_note and gpipe_note in capsys.readouterr().err
    page = write_report(out).read_text()
    assert _stage_memory(page) == ("memory", [fmt_bytes(b) for b in planned])
    assert "warning" not in page and "in flight (" not in page
