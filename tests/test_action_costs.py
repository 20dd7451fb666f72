"""The engine's own work per action (``action_ms``, cost/engine_price.py): added to every action
of its stage by the simulator, exact on tiny schedules worked by hand, kept at other rows;
written into a train plan's ``simulator_costs`` by ``price_engine`` (a costs file's probe, else
the CPU default, 0 on CUDA) and read back from plan.json by the simulation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from onnx_partition.cli.summary.partition import plan_table
from onnx_partition.cost.annotate import load_costs
from onnx_partition.cost.cluster import Cluster
from onnx_partition.cost.engine_price import (
    ACTION_MS,
    BARRIERS_PER_STEP,
    action_ms,
    hop_ms,
    measured_step_ms,
    price_engine,
    probe_of,
)
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import played_comm, simulate_plan
from onnx_partition.pipeline.predict import simulation_json
from onnx_partition.pipeline.schedules import Kind, build
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import read_plan
from onnx_partition.plan.contracts import COSTS_FORMAT
from onnx_partition.report.lines import devices_line


def _stages(n: int, action: float, **more: float) -> PipelineCosts:
    return PipelineCosts([StageCosts(1.0, 2.0, backward_input_ms=1.0, action_ms=action, **more)
                          for _ in range(n)], [0.5] * (n - 1))


def test_one_stage_pays_the_action_work_on_every_action() -> None:
    """One stage, 2 micro-batches, F 1, B 2 (I 1, W 1), 0.5 ms per action: 1F1B runs F B F B,
    2 x 1.5 + 2 x 2.5 = 8 (6 without); ZB-H1 F I W F I W, 6 x 1.5 = 9; inference F F, 3; the
    step term after it, once. All of it busy: the work occupies the core."""
    one = _stages(1, 0.5)
    assert one.stages[0].duration(Kind.F) == 1.5 and one.stages[0].duration(Kind.W) == 1.5
    result = simulate(build("1f1b", [1], 2), one)
    assert result.iteration_ms == 8.0 and result.busy_ms == {(0, 0): 8.0}
    assert simulate(build("1f1b", [1], 2), _stages(1, 0.0)).iteration_ms == 6.0
    assert simulate(build("zb-h1", [1], 2), one).iteration_ms == 9.0
    assert simulate(build("infer", [1], 2), one).iteration_ms == 3.0
    assert simulate(build("1f1b", [1], 2), _stages(1, 0.5, step_ms=3.0)).iteration_ms == 11.0


def test_two_stages_one_f_one_b_and_zb_h1_by_hand() -> None:
    """2 stages, 2 micro-batches, F 1, B 2 (I 1, W 1), sends 0.5, 0.25 ms per action.
    1F1B: s0 F0 0-1.25, F1 -2.5; s1 F0 1.75-3, B0 -5.25, F1 -6.5, B1 -8.75; s0 B0 5.75-8,
    B1 9.25-11.5 (10 without: six actions on the critical path). ZB-H1: s1 F0 1.75-3, I0 -4.25,
    F1 -5.5, I1 -6.75, W0 -8, W1 -9.25; s0 I0 4.75-6, W0 -7.25, I1 7.25-8.5, W1 -9.75 (8
    without: seven on the path)."""
    costs = _stages(2, 0.25)
    one_f = simulate(build("1f1b", [1, 1], 2), costs)
    assert one_f.iteration_ms == 11.5 and one_f.busy_ms == {(0, 0): 7.0, (1, 0): 7.0}
    assert simulate(build("1f1b", [1, 1], 2), _stages(2, 0.0)).iteration_ms == 10.0
    zb = simulate(build("zb-h1", [1, 1], 2), costs)
    assert zb.iteration_ms == 9.75 and zb.busy_ms == {(0, 0): 7.5, (1, 0): 7.5}
    assert simulate(build("zb-h1", [1, 1], 2), _stages(2, 0.0)).iteration_ms == 8.0


def test_at_rows_keeps_the_work_per_action() -> None:
    """Twice the rows: F 2, B 4, the 0.5 ms per action kept: 2 x 2.5 + 2 x 4.5 = 14."""
    doubled = _stages(1, 0.5).at_rows(2.0)
    assert doubled.stages[0].action_ms == 0.5
    assert simulate(build("1f1b", [1], 2), doubled).iteration_ms == 14.0


def _costs_file(path: Path, plan_nodes: list[str], device: str, engine: dict) -> Path:
    nodes = {key: {"forward_ms": 0.1, "backward_ms": 0.2} for key in plan_nodes}
    path.write_text(json.dumps({"format": COSTS_FORMAT, "unit": "ms", "mode": "train",
                                "device": device, "engine": engine, "nodes": nodes}))
    return path


_ENGINE = {"parameter_bytes": 1000, "optimizer_ms": {"adamw": 2.0, "sgd": 1.0},
           "accumulate_ms": 0.5, "barrier_ms": 0.25,
           "link": {"latency_ms": 0.5, "bandwidth_gbps": 1.0, "sizes": [1, 1_000_001],
                    "one_way_ms": [0.5, 1.5]}}


def test_the_probe_prices_actions_barriers_and_hops(exported, tmp_path: Path) -> None:
    """A costs file whose ``engine`` has a probe: its ``action_ms`` per action of every stage,
    its ``barrier_ms`` as each of the step's barriers, its ``hop_ms`` on every hop."""
    plan = partition(exported("gpt"), 2, tmp_path / "plan", mode="train", check=False,
                     batch_size=2)
    keys = [key for stage in plan.stages for key in stage.nodes]
    probe = {"action_ms": 0.375, "barrier_ms": 1.5, "hop_ms": 0.125}
    probed = load_costs(_costs_file(tmp_path / "probed.json", keys, "cpu",
                                    {**_ENGINE, "probe": probe}))
    priced = copy.deepcopy(plan)
    price_engine(priced, costs=probed, device=None)
    sim = priced.simulator_costs
    assert sim["action_ms"] == [0.375, 0.375]
    weights = [float(s.predicted.weights_bytes or 0) for s in priced.stages if s.predicted]
    assert sim["step_ms"] == pytest.approx(
        [2.0 * w / 1000 + BARRIERS_PER_STEP * 1.5 for w in weights], abs=1e-6)
    hop = sim["hop_bytes"][0]
    assert sim["send_ms"] == pytest.approx([0.5 + (hop - 1) / 1e6 + 0.125], abs=1e-6)
    said = priced.extra["engine_costs"]
    assert said["action_ms"].startswith("measured") and "probe" in said["send_ms"]
    assert "probe" in said["step_ms"]
    # the summary says which hop time the simulation plays, not only the link that cut it
    sends = priced.simulator_costs["send_ms"][0]
    assert devices_line(priced).endswith(
        f"; train hops priced as measured: {sends:.3g} ms (measured, plan.json "
        "engine_costs.send_ms)")
    assert "hops priced" not in devices_line(plan)  # partition's own plan: the CPU default
    # ... and so does the table: each stage's boundary played both ways at the measured hop,
    # beside the link model's comm that shaped the cut
    assert played_comm(priced) == pytest.approx([2 * sends, 2 * sends])
    table = plan_table(priced)
    assert "comm ms  comm ms (played)  total ms" in table
    comm = priced.stages[0].predicted.comm_ms
    assert f"  {comm:.3f}  {2 * sends:16.3f}  " in table.splitlines()[2]
    assert table.endswith("at plan.json simulator_costs.send_ms (measured).")
    result, _ = simulate_plan(priced)
    figures = simulation_json(priced, result, schedule="1f1b", microbatches=8, batch_size=2)
    assert [s["comm_played_ms"] for s in figures["stages"]] == pytest.approx([2 * sends] * 2)
    assert [s["comm_ms"] for s in figures["stages"]] == [comm, comm]
    # priced again: sends from the measured link are priced afresh, the probe's hop once
    price_engine(priced, costs=probed, device=None)
    assert priced.simulator_costs["send_ms"] == pytest.approx(
        [0.5 + (hop - 1) / 1e6 + 0.125], abs=1e-6)
    # the same file without the probe: the CPU default, the two-process barrier, the bare hop
    plain = copy.deepcopy(plan)
    price_engine(plain, costs=load_costs(_costs_file(tmp_path / "plain.json", keys, "cpu",
                                                     _ENGINE)), device=None)
    assert plain.simulator_costs["action_ms"] == [ACTION_MS, ACTION_MS]
    assert plain.simulator_costs["step_ms"] == pytest.approx(
        [2.0 * w / 1000 + BARRIERS_PER_STEP * 0.25 for w in weights], abs=1e-6)
    assert plain.simulator_costs["send_ms"] == pytest.approx([hop_ms(hop, [1, 1_000_001],
                                                                     [0.5, 1.5])], abs=1e-6)
    assert plain.extra["engine_costs"]["action_ms"].startswith("analytic")
    # measured on CUDA, no probe: 0 (the host's work overlaps the asynchronous kernels)
    cuda = copy.deepcopy(plan)
    price_engine(cuda, costs=load_costs(_costs_file(tmp_path / "cuda.json", keys, "cuda:0",
                                                    _ENGINE)), device=None)
    assert cuda.simulator_costs["action_ms"] == [0.0, 0.0]
    assert "CUDA" in cuda.extra["engine_costs"]["action_ms"]


def test_probe_reading_is_strict_about_numbers() -> None:
    assert probe_of({"probe": {"action_ms": 0.5}}) == {"action_ms": 0.5}
    assert probe_of({"probe": {"action_ms": "0.5"}}) is None
    assert probe_of({"probe": {"barrier_ms": 1.0}}) is None and probe_of(None) is None
    assert action_ms({"probe": {"action_ms": 0.5}}, cuda=True)[0] == 0.5  # measured wins
    assert action_ms(None, cuda=False)[0] == ACTION_MS and action_ms(None, cuda=True)[0] == 0.0
    engine = {"parameter_bytes": 100, "optimizer_ms": {"adamw": 10.0}, "barrier_ms": 0.5}
    assert measured_step_ms([100.0], "adamw", engine) == pytest.approx([11.0])
    assert measured_step_ms([100.0], "adamw", {**engine, "probe": {
        "action_ms": 0.1, "barrier_ms": 2.0}}) == pytest.approx([14.0])


def test_a_hybrid_plans_probed_hops_are_said_and_shown(exported, tmp_path: Path) -> None:
    """A hybrid train plan keeps the link model's sends (no ``hop_bytes``): the probe adds its
    ``hop_ms`` to each; the summary line names those hops, and the table shows each stage's
    boundary played both ways at them beside the link model's ``comm_ms`` (2 x the link)."""
    plan = partition(exported("gpt"), 2, tmp_path / "plan", mode="train", check=False,
                     batch_size=2, cluster=Cluster(devices_per_machine=2))
    link = plan.simulator_costs["send_ms"][0]
    assert played_comm(plan) is None and "(played)" not in plan_table(plan)
    assert "hops priced" not in devices_line(plan)
    keys = [key for stage in plan.stages for key in stage.nodes]
    probed = load_costs(_costs_file(tmp_path / "probed.json", keys, "cpu", {
        **_ENGINE, "probe": {"action_ms": 0.375, "barrier_ms": 1.5, "hop_ms": 0.125}}))
    price_engine(plan, costs=probed, device=None)
    assert plan.simulator_costs["send_ms"] == pytest.approx([link + 0.125], abs=1e-6)
    assert devices_line(plan).endswith(
        f"; train hops priced as measured: {link + 0.125:.3g} ms (the link model + the probe's "
        "work per hop, plan.json engine_costs.send_ms)")
    assert [s.predicted.comm_ms for s in plan.stages] == pytest.approx([2 * link] * 2, abs=1e-6)
    assert played_comm(plan) == pytest.approx([2 * (link + 0.125)] * 2, abs=1e-6)
    assert "comm ms  comm ms (played)  total ms" in plan_table(plan)


def test_a_cpu_train_plan_round_trips_its_action_work(exported, tmp_path: Path) -> None:
    """``partition --mode train`` on a CPU writes :data:`ACTION_MS` per stage; read back from
    plan.json the simulation pays it on every action: one stage, one device, so the iteration
    grows by exactly the schedule's actions (2 per micro-batch under 1F1B, 3 under ZB-H1)
    times it; the plan's predicted iteration is that simulation. Inference plans carry none."""
    plan = partition(exported("gpt"), 1, tmp_path / "plan", mode="train", check=False,
                     batch_size=2, microbatches=4)
    assert plan.simulator_costs["action_ms"] == [ACTION_MS]
    back = read_plan(tmp_path / "plan")
    assert back.simulator_costs["action_ms"] == [ACTION_MS]
    result, costs = simulate_plan(back)
    assert costs.stages[0].action_ms == ACTION_MS
    bare = copy.deepcopy(back)
    bare.simulator_costs.pop("action_ms")
    per_mb = 3 if back.extra["schedule"] == "zb-h1" else 2
    assert result.iteration_ms == pytest.approx(
        simulate_plan(bare)[0].iteration_ms + 4 * per_mb * ACTION_MS, abs=1e-9)
    assert back.predicted["iteration_ms"] == pytest.approx(result.iteration_ms, abs=1e-5)
    # forward streaming of a train plan (what run executes in onnxruntime): not the engine's
    assert simulate_plan(back, schedule="infer")[1].stages[0].action_ms == 0.0
    infer = partition(exported("gpt"), 1, tmp_path / "infer", check=False, batch_size=2)
    assert "action_ms" not in infer.simulator_costs
