"""profile --plan: stage times alone and side by side, re-pricing, and the calibrated plan."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from support.cli import one_error
from support.graphs import CHAIN, feeds_for, save
from support.outputs import assert_same, run_chained, run_whole

from onnx_partition import export
from onnx_partition.calibrate.recut import calibrate_plan, measure_plan, stage_keys
from onnx_partition.cli import main
from onnx_partition.cost.profile.stages import reprice, time_stages
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.plan import read_plan
from onnx_partition.plan.folder import verify


def test_reprice_scales_each_stage_to_its_measured_time() -> None:
    costs = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 2.0, "e": 0.0, "f": 0.0, "x": 7.0}
    out = reprice(costs, [["a", "b"], ["c", "d"], ["e", "f"]], [8.0, 2.0, 3.0])
    assert out == {"a": 2.0, "b": 6.0, "c": 1.0, "d": 1.0, "e": 1.5, "f": 1.5, "x": 7.0}


def test_reprice_refuses_a_count_mismatch() -> None:
    with pytest.raises(Exception, match="2 stages, 1 measured"):
        reprice({"a": 1.0}, [["a"], ["b"]], [1.0])


def test_time_stages_counts_every_run_and_reports_failures() -> None:
    calls = [0, 0]

    def make(k: int):  # type: ignore[no-untyped-def]
        def run() -> None:
            calls[k] += 1
        return run

    timed = time_stages([make(0), make(1)], repeats=3, warmup=1)
    assert len(timed.alone_ms) == len(timed.together_ms) == 2
    assert all(t >= 0 for t in [*timed.alone_ms, *timed.together_ms])
    assert all(c >= 2 * (3 + 1) for c in calls)  # 4 alone, then at least 4 side by side
    one = time_stages([make(0)], repeats=2, warmup=0)
    assert one.together_ms == one.alone_ms

    def broken() -> None:
        raise ValueError("stage broke")

    with pytest.raises(ValueError, match="stage broke"):
        time_stages([make(0), broken], repeats=2, warmup=0)


@pytest.fixture
def chain_plan(tmp_path: Path) -> tuple[Path, Path]:
    model = save(CHAIN, tmp_path / "chain.onnx")
    plan = tmp_path / "plan"
    partition(model, 2, plan, batch_size=3)
    return model, plan


def test_calibrated_plan_is_priced_by_its_side_by_side_times(chain_plan, tmp_path) -> None:
    model, folder = chain_plan
    before = read_plan(folder)
    out = tmp_path / "calibrated"
    done = calibrate_plan(folder, out=out, rounds=2, repeats=3, warmup=1)
    assert read_plan(folder).to_json() == before.to_json()  # -o: the original is untouched
    plan = read_plan(out)
    verify(out, plan)  # the manifest holds: every stage file as listed
    assert (out / plan.model).resolve() == model.resolve()
    record = plan.extra["calibrated"]
    chosen = record["rounds"][record["chosen_round"] - 1]
    assert [s.predicted.compute_ms for s in plan.stages] == chosen["together_ms"]
    assert chosen["stages"] == [len(n) for n in stage_keys(plan)]
    assert len(record["rounds"]) <= 2 and record["converged"] == done.converged
    bottleneck = max(s.predicted.compute_ms + s.predicted.comm_ms for s in plan.stages)
    assert plan.predicted["bottleneck_ms"] == pytest.approx(bottleneck, abs=1e-6)
    result, _ = simulate_plan(plan)  # simulate reads the calibrated times
    assert plan.predicted["iteration_ms"] == pytest.approx(result.iteration_ms, abs=1e-6)
    assert plan.predicted["throughput_per_s"] == pytest.approx(
        plan.microbatches / result.iteration_ms * 1000, rel=1e-6)
    slowest = max(s.predicted.compute_ms for s in plan.stages)
    assert result.iteration_ms >= slowest * plan.microbatches - 1e-6
    feeds = feeds_for(3)
    assert_same(run_chained(out, feeds), run_whole(model, feeds))


def test_in_place_and_from_the_command_line(chain_plan, capsys) -> None:
    _, folder = chain_plan
    code = main(["profile", "--plan", str(folder), "--repeats", "2", "--rounds", "1"])
    assert code == 0
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert "round 1: stages of" in said and "side by side" in said
    body = json.loads((folder / "plan.json").read_text())
    assert body["calibrated"]["by"] == "profile --plan"
    assert len(body["calibrated"]["rounds"]) == 1
    assert len(measure_plan(folder, repeats=2, warmup=0).together_ms) == 2


def test_bad_requests_are_one_line_and_write_nothing(chain_plan, tmp_path, capsys) -> None:
    model, folder = chain_plan
    before = (folder / "plan.json").read_text()
    one_error(capsys, ["profile", str(model), "--plan", folder], "takes no MODEL")
    one_error(capsys, ["profile", "--plan", folder, "--rounds", "0"], "--rounds must be")
    one_error(capsys, ["profile", "--plan", tmp_path / "nowhere"], "not a plan folder")
    one_error(capsys, ["profile", str(model)], "-o COSTS")
    one_error(capsys, ["profile", "--plan", folder, "--batch-size", "2"], "own devices")
    body = json.loads(before)
    body["mode"] = "train"
    train = tmp_path / "train"
    train.mkdir()
    (train / "plan.json").write_text(json.dumps(body))
    one_error(capsys, ["profile", "--plan", train], "no exported program")
    assert (folder / "plan.json").read_text() == before
    assert not list(tmp_path.glob(".*calibrating"))


def test_a_train_plan_is_calibrated_on_its_stage_modules(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    model = export(module, (torch.randn(2, 8),), tmp_path / "block.onnx", input_names=["x"])
    folder = tmp_path / "plan"
    partition(model, 2, folder, batch_size=4, mode="train")
    assert main(["profile", "--plan", str(folder), "--rounds", "1", "--repeats", "2"]) == 0
    captured = capsys.readouterr()
    assert "in the engine (" in captured.out + captured.err
    plan = read_plan(folder)
    record = plan.extra["calibrated"]
    assert record["executor"].startswith("torch ") and "processes" in record["side_by_side"]
    # the stages' compute is the plan's own run in the engine: forward as there, backward less
    # the gradients' accumulation (which the simulator adds to every micro-batch but the first)
    run = record["engine_run"]
    forward = [s.predicted.forward_ms for s in plan.stages]
    backward = [s.predicted.backward_ms for s in plan.stages]
    assert forward == run["forward_ms"]
    adds = (run["microbatches"] - 1) / run["microbatches"]
    for b, got, acc in zip(backward, run["backward_ms"], plan.simulator_costs["accumulate_ms"],
                           strict=True):
        assert b == pytest.approx(max(got - acc * adds, 0.0), abs=2e-6)
    assert plan.simulator_costs["forward_ms"] == forward
    assert plan.simulator_costs["backward_ms"] == backward
    for stage, f, b in zip(plan.stages, forward, backward, strict=True):
        assert stage.predicted.compute_ms == pytest.approx(f + b, abs=1e-6)
    assert all(b > 0 for b in backward)  # every stage has weights to differentiate
    # the engine's own work measured on the stage modules and between two processes: the
    # hop's bytes (4 rows x 16 floats out of the first Linear, or the GELU's), a step term per
    # stage, both in the simulation the plan predicts
    sim = plan.simulator_costs
    assert sim["hop_bytes"] == [4 * 16 * 4]
    assert len(sim["send_ms"]) == 1 and sim["send_ms"][0] > 0
    assert len(sim["step_ms"]) == 2 and all(t > 0 for t in sim["step_ms"])
    assert len(sim["accumulate_ms"]) == 2 and all(t > 0 for t in sim["accumulate_ms"])
    assert plan.extra["engine_costs"]["step_ms"].startswith("calibrated")
    # the engine's work per action, one figure per stage; each hop the idle ping-pong's plus
    # the extra fitted to the run's step
    assert len(sim["action_ms"]) == 2 and all(a > 0 for a in sim["action_ms"])
    assert run["hop_ms"] >= 0 and sim["send_ms"] == pytest.approx(
        [s + run["hop_ms"] for s in run["idle_send_ms"]], abs=2e-6)
    assert "split_ms" not in sim  # the passes were timed as the engine runs them
    if plan.extra["schedule"] == "zb-h1":  # the backward timed as the engine's two passes
        assert len(sim["backward_input_ms"]) == 2
        assert all(0 <= i <= b for i, b in zip(sim["backward_input_ms"], backward, strict=True))
    else:
        assert "backward_input_ms" not in sim
    # the memory model calibrated on the run: each stage's peak there, its activations measured
    memory = run["memory"]["stages"]
    for stage, got in zip(plan.stages, memory, strict=True):
        assert got["calibrated"] and got["measured_peak_bytes"] > 0
        assert stage.predicted.memory_bytes == max(got["measured_peak_bytes"],
                                                   got["calibrated_bytes"])
        assert stage.predicted.activation_bytes == got["measured_activation_bytes"]
    bare = copy.deepcopy(plan)
    bare.simulator_costs.pop("step_ms")
    assert plan.predicted["iteration_ms"] == pytest.approx(
        simulate_plan(bare)[0].iteration_ms + max(sim["step_ms"]), abs=1e-5)


def test_a_re_cut_keeps_the_schedule_precision_and_recompute(tmp_path: Path) -> None:
    """profile --plan cuts a train plan again for what it was planned for: its schedule
    (auto takes ZB-H1 on these costs), its precision and its --recompute (recorded in
    plan.json only when not auto, so default plans are unchanged)."""
    from onnx_partition.calibrate.recut import _resolve
    from onnx_partition.cost.annotate import load_costs, write_costs
    from onnx_partition.graph import load

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    model = export(module, (torch.randn(2, 8),), tmp_path / "block.onnx", input_names=["x"])
    graph = load(model, batch_size=4)
    costs = tmp_path / "costs.json"
    write_costs(costs, {n.key: {"forward_ms": 1.0, "backward_ms": 2.0, "backward_input_ms": 1.0,
                                "backward_weight_ms": 1.0}
                        for n in graph.nodes if n.op_type != "Constant"}, mode="train")
    default = partition(model, 2, tmp_path / "auto", batch_size=4, mode="train", costs=costs)
    assert default.extra["schedule"] == "zb-h1" and "recompute" not in default.extra
    plan = partition(model, 2, tmp_path / "plan", batch_size=4, mode="train", costs=costs,
                     schedule="1f1b", recompute="all", precision="bf16")
    assert read_plan(tmp_path / "plan").extra["recompute"] == "all"
    again = _resolve(model, read_plan(tmp_path / "plan"), graph, load_costs(costs),
                     tmp_path / "again")
    assert (again.extra["schedule"], again.extra["precision"], again.extra["recompute"]) == (
        "1f1b", "bf16", "all")
    assert [s.recompute for s in again.stages] == [True, True]
    assert [s.nodes for s in again.stages] == [s.nodes for s in plan.stages]
