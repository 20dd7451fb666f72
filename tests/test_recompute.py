"""Recomputation per stage: the memory model by hand and against the simulator, the per-stage
choice, the planner choosing it only when memory needs it, and plans that record and replay it."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from support.cli import one_error
from support.graphs import CHAIN, save
from support.problems import chain

from onnx_partition.cli import main
from onnx_partition.cost.annotate import write_costs
from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.pipeline.memory import (
    StageBytes,
    memory_parts,
    memory_per_device,
    recompute_choice,
    stash_bytes,
    static_bytes,
)
from onnx_partition.pipeline.schedules import build
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import read_plan
from onnx_partition.solve.hybrid_proof import HybridProof, prove_hybrid
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.scoring import RunSpec

# two stages: weights 10 B, activations 100 B per micro-batch, 5 B received, 3 B sent back
STAGES = [StageBytes(10.0, 100.0, 0.0, 5.0), StageBytes(10.0, 100.0, 5.0, 0.0)]


def test_memory_with_recompute_by_hand() -> None:
    """1F1B, 2 stages, 4 micro-batches: stage 0 holds 2, stage 1 one. Adam: 4 x 10 + sent.
    Keeping activations: 45 + 2 x 100 = 245 and 40 + 1 x 105 = 145. Recomputing: one
    micro-batch's activations plus the inputs of those held: 45 + 100 + 2 x 0 = 145 and
    40 + 100 + 1 x 5 = 145."""
    assert memory_per_device(STAGES, [1, 1], 4, schedule="1f1b") == [245.0, 145.0]
    assert memory_per_device(STAGES, [1, 1], 4, schedule="1f1b",
                             recompute=[True, True]) == [145.0, 145.0]
    # ZB-H1: both hold 2; stage 1 defers one W, so holds two rebuilt micro-batches
    assert memory_per_device(STAGES, [1, 1], 4, schedule="zb-h1") == [245.0, 250.0]
    assert memory_per_device(STAGES, [1, 1], 4, schedule="zb-h1",
                             recompute=[True, True]) == [145.0, 250.0]
    parts = memory_parts(STAGES[0], 2, train=True, rebuilt=1)
    assert parts["inflight"] == 1 and parts["buffer_bytes"] == 5
    assert parts["memory_bytes"] == 145 == (parts["weights_bytes"] + parts["grad_bytes"]
                                            + parts["optimizer_bytes"] + parts["buffer_bytes"]
                                            + parts["inflight"] * parts["activation_bytes"])
    # inference never recomputes
    assert memory_per_device(STAGES, [1, 1], 1, schedule="infer",
                             recompute=[True, True]) == [110.0, 115.0]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("replicas", [[1], [1, 1, 1], [2, 1], [1, 2, 2], [3, 2, 1]])
def test_closed_form_equals_the_simulator(schedule: str, replicas: list[int]) -> None:
    p = len(replicas)
    sizes = [StageBytes(10.0 * (k + 1), 1000.0 + 7 * k, 50.0 * k + 3,
                        50.0 * (k + 1) if k < p - 1 else 0.0) for k in range(p)]
    for m, flags in itertools.product((1, 3, 8), itertools.product((False, True), repeat=p)):
        costs = PipelineCosts(
            [StageCosts(1.0, 2.0, d, 0.0, stash_bytes(s), static_bytes(s, train=True,
                                                                       optimizer_factor=4.0),
                        recompute=rc, input_bytes=s.received)
             for s, d, rc in zip(sizes, replicas, flags, strict=True)], [0.1] * (p - 1))
        sim = simulate(build(schedule, replicas, m), costs)
        got = [max(sim.peak_memory_bytes[(k, r)] for r in range(d))
               for k, d in enumerate(replicas)]
        assert got == pytest.approx(memory_per_device(sizes, replicas, m, schedule=schedule,
                                                      recompute=list(flags)))


def test_recomputing_costs_one_forward_per_backward() -> None:
    """One stage, forward 1, backward 2, 3 micro-batches: 9 ms; recomputing: 3 x (1 + 3)."""
    plain = PipelineCosts([StageCosts(1.0, 2.0)], [])
    again = PipelineCosts([StageCosts(1.0, 2.0, recompute=True)], [])
    assert simulate(build("1f1b", [1], 3), plain).iteration_ms == 9.0
    assert simulate(build("1f1b", [1], 3), again).iteration_ms == 12.0
    assert simulate(build("zb-h1", [1], 3), again).iteration_ms == 12.0  # I gets the forward


def test_recompute_choice_only_where_needed() -> None:
    choose = dict(schedule="1f1b", memory_bytes=200.0)
    assert recompute_choice(STAGES, [1, 1], 4, mode="auto", **choose) == [True, False]
    assert recompute_choice(STAGES, [1, 1], 4, mode="none", **choose) == [False, False]
    assert recompute_choice(STAGES, [1, 1], 4, mode="all", **choose) == [True, True]
    assert recompute_choice(STAGES, [1, 1], 4, mode="auto", schedule="1f1b",
                            memory_bytes=math.inf) == [False, False]
    # over even when recomputing: left as is (the plan is refused)
    assert recompute_choice(STAGES, [1, 1], 4, mode="auto", schedule="1f1b",
                            memory_bytes=100.0) == [False, False]
    with pytest.raises(ValueError, match="recompute must be one of"):
        recompute_choice(STAGES, [1, 1], 4, mode="some", **choose)


def _run(gb: float, recompute: str, schedule: str = "1f1b") -> RunSpec:
    return RunSpec(Cluster(1, 2, memory_gb=gb, kind="cuda", intra=Link(1000.0, 0.0)),
                   train=True, microbatches=8, recompute=recompute, train_schedule=schedule)


def test_planner_recomputes_only_when_memory_needs_it() -> None:
    """Four 1 ms nodes, 1 GB activations each, two devices. At 4 GB and more the best plan is
    two data-parallel replicas holding one micro-batch each: no recomputation (auto equals
    none). At 3 GB nothing fits keeping activations; with recomputation the pipeline 2 | 2
    fits, its first stage (holding two micro-batches) recomputing, within 3 GB simulated."""
    problem, arrays = chain([1.0] * 4, nbytes=1e9)
    for gb in (4.0, 20.0):
        none, _ = plan_cluster(problem, arrays, _run(gb, "none"))
        auto, _ = plan_cluster(problem, arrays, _run(gb, "auto"))
        assert (auto.stage_of, auto.replicas) == (none.stage_of, none.replicas) == (
            [0, 0, 0, 0], [2])
        assert auto.sim.iteration_ms == none.sim.iteration_ms
        assert not any(s.recompute for s in auto.costs.stages)
    with pytest.raises(PartitionError, match="no plan fits in 3 GB"):
        plan_cluster(problem, arrays, _run(3.0, "none"))
    plan, _ = plan_cluster(problem, arrays, _run(3.0, "auto"))
    assert (plan.stage_of, plan.replicas) == ([0, 0, 1, 1], [1, 1])
    assert [s.recompute for s in plan.costs.stages] == [True, False]
    assert max(plan.sim.peak_memory_bytes.values()) <= 3e9
    assert plan.memory_bytes == pytest.approx([3e9, 3e9])
    # the CP-SAT judge models no recomputation: no proof claimed for a recomputing plan
    assert prove_hybrid(problem, arrays, _run(3.0, "auto"), plan) == HybridProof(
        False, "recompute")
    every, _ = plan_cluster(problem, arrays, _run(3.0, "all"))
    assert [s.recompute for s in every.costs.stages] == [True, True]
    assert every.sim.iteration_ms > plan.sim.iteration_ms


def test_plans_record_schedule_and_recompute(tmp_path: Path) -> None:
    """plan.json names the schedule it was planned for (infer plans: infer) and the stages
    that recompute; simulate honours both, and plans otherwise keep their split."""
    model = save(CHAIN, tmp_path / "chain.onnx")
    infer = partition(model, 2, tmp_path / "infer", batch_size=4)
    assert infer.extra["schedule"] == "infer"
    assert not any("recompute" in s for s in read_plan(tmp_path / "infer").to_json()["stages"])
    # measured costs: 1 ms forward, 2 ms backward of which 1 ms input gradient, per node
    costs = tmp_path / "costs.json"
    write_costs(costs, {k: {"forward_ms": 1.0, "backward_ms": 2.0, "backward_input_ms": 1.0,
                            "backward_weight_ms": 1.0} for k in "abdefy"}, mode="train")
    one = partition(model, 3, tmp_path / "one", batch_size=4, mode="train", schedule="1f1b",
                    costs=costs)
    auto = partition(model, 3, tmp_path / "auto", batch_size=4, mode="train", costs=costs)
    assert one.extra["schedule"] == "1f1b" and auto.extra["schedule"] == "zb-h1"
    assert [s.nodes for s in one.stages] == [s.nodes for s in auto.stages]
    assert auto.extra["simulator_costs"]["backward_input_ms"] == [
        s.predicted.backward_ms / 2 for s in auto.stages]
    assert simulate_plan(read_plan(tmp_path / "auto"))[0].schedule == "zb-h1"
    zb, _ = simulate_plan(read_plan(tmp_path / "auto"))
    plain, _ = simulate_plan(read_plan(tmp_path / "auto"), schedule="1f1b")
    assert zb.iteration_ms <= plain.iteration_ms
    every = partition(model, 3, tmp_path / "all", batch_size=4, mode="train", schedule="1f1b",
                      recompute="all", costs=costs)
    assert [s.recompute for s in read_plan(tmp_path / "all").stages] == [True] * 3
    assert [s.nodes for s in every.stages] == [s.nodes for s in one.stages]
    again, _ = simulate_plan(read_plan(tmp_path / "all"))
    kept, _ = simulate_plan(read_plan(tmp_path / "one"))
    assert again.iteration_ms > kept.iteration_ms
    assert all(a.predicted.memory_bytes <= b.predicted.memory_bytes
               for a, b in zip(every.stages, one.stages, strict=True))
    with pytest.raises(PartitionError, match="cannot plan for schedule 'gpipe'"):
        partition(model, 3, tmp_path / "x", batch_size=4, mode="train", schedule="gpipe")


def test_command_line_schedule_and_recompute(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """partition --schedule/--recompute reach the plan; simulate defaults to its schedule;
    --schedule without --mode train is a one-line error."""
    model = save(CHAIN, tmp_path / "chain.onnx")
    one_error(capsys, ["partition", str(model), "--stages", "2", "--batch-size", "4",
                       "--schedule", "zb-h1", "-o", str(tmp_path / "x")],
              "--schedule plans a training schedule: it needs --mode train")
    assert not (tmp_path / "x").exists()
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--stages", "2", "--batch-size", "4", "--mode",
                 "train", "--no-program", "--schedule", "zb-h1", "--recompute", "all",
                 "-o", str(out), "-q"]) == 0
    plan = read_plan(out)
    assert plan.extra["schedule"] == "zb-h1" and [s.recompute for s in plan.stages] == [True] * 2
    capsys.readouterr()
    assert main(["simulate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "zb-h1"
    assert main(["simulate", str(out)]) == 0
    text = capsys.readouterr().out
    assert "simulated zb-h1 iteration" in text and "stages 0, 1 recompute" in text



def test_auto_schedule_pays_the_split_backward(tmp_path: Path) -> None:
    """ZB-H1 runs each backward as two passes, which costs ``split_call_ms`` per weight group
    (``engine`` in the costs file): ``--schedule auto`` weighs it, on plain and cluster plans
    alike, keeping ZB-H1 while it wins (free split) and 1F1B once it does not."""
    model = save(CHAIN, tmp_path / "chain.onnx")
    for call_ms, expected in ((0.0, "zb-h1"), (50.0, "1f1b")):
        costs = tmp_path / f"costs-{call_ms}.json"
        write_costs(costs, {k: {"forward_ms": 1.0, "backward_ms": 2.0, "backward_input_ms": 1.0,
                                "backward_weight_ms": 1.0} for k in "abdefy"}, mode="train",
                    engine={"split_call_ms": call_ms})
        plain = partition(model, 3, tmp_path / f"plain-{call_ms}", batch_size=4, mode="train",
                          costs=costs)
        cluster = partition(model, 3, tmp_path / f"cluster-{call_ms}", batch_size=4,
                            mode="train", costs=costs, cluster=Cluster(devices_per_machine=3))
        assert [s.replicas for s in cluster.stages] == [1, 1, 1]
        assert plain.extra["schedule"] == cluster.extra["schedule"] == expected
        if expected == "zb-h1":  # the split is priced, and free here
            assert plain.extra["simulator_costs"]["split_ms"] == [0.0, 0.0, 0.0]
        else:  # 1F1B: no split, and its replay is what was predicted
            assert "split_ms" not in plain.extra["simulator_costs"]
            replay, _ = simulate_plan(read_plan(tmp_path / f"plain-{call_ms}"))
            assert replay.iteration_ms == pytest.approx(plain.predicted["iteration_ms"])


def test_every_verb_names_the_recomputing_stages(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """partition's summary, simulate (text and --json), report and train's summary (text and
    --json) name the stages plan.json marks recomputing, in one wording; partition --json and
    simulate --json mark the same stages."""
    from support.training import rank_run

    from onnx_partition.cli.summary.train import format_train
    from onnx_partition.pipeline.from_plan import recompute_line
    from onnx_partition.report.page import write_report
    from onnx_partition.runtime.train.rank_io import RankResult
    from onnx_partition.runtime.train.results import summarize, train_json

    assert recompute_line([]) is None
    assert recompute_line([1]) == ("stage 1 recomputes its forward in backward (keeping only "
                                   "its inputs per micro-batch in flight)")
    line = recompute_line([0, 1])
    assert line == ("stages 0, 1 recompute their forward in backward (keeping only their "
                    "inputs per micro-batch in flight)")
    model = save(CHAIN, tmp_path / "chain.onnx")
    out = tmp_path / "plan"
    argv = ["partition", str(model), "--stages", "2", "--batch-size", "4", "--mode", "train",
            "--no-program", "--schedule", "1f1b", "--recompute", "all", "-o", str(out)]
    assert main(argv) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert main([*argv, "--force", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(out)]) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert main(["simulate", str(out), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert [s.get("recompute") for s in simulated["stages"]] == [True, True] == [
        s.get("recompute") for s in planned["stages"]]
    assert simulated["iteration_ms"] == planned["iteration_ms"]
    assert line[0].upper() + line[1:] in write_report(out).read_text()  # a sentence there
    plan = read_plan(out)
    ranks = [RankResult(rank=k, stage=k, replica=0, actions=[], peak_inflight=1, step_ms=[1.0],
                        forward_ms=[1.0], backward_ms=[1.0], loss=[0.0]) for k in (0, 1)]
    stats = summarize(plan, ranks, rank_run(steps=1, microbatches=8, schedule="1f1b"),
                      32, "ours")
    assert f"  {line}" in format_train(stats).splitlines()
    assert train_json(stats)["recompute"] == [0, 1]
    assert stats.simulated_ms == pytest.approx(planned["iteration_ms"])
    # a plan that keeps every activation says nothing of it
    kept = tmp_path / "kept"
    assert main([*argv[:-3], "none", "-o", str(kept)]) == 0
    assert "recompute" not in capsys.readouterr().out
    assert main(["simulate", str(kept), "--json"]) == 0
    assert not any("recompute" in s for s in json.loads(capsys.readouterr().out)["stages"])


def test_recompute_needs_train_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--recompute of an inference plan is refused, not ignored."""
    model = save(CHAIN, tmp_path / "chain.onnx")
    one_error(capsys, ["partition", model, "--stages", "2", "--batch-size", "4",
                       "--recompute", "all", "-o", tmp_path / "x"],
              "--recompute trades a training stage's memory for time: it needs --mode train")
    assert not (tmp_path / "x").exists()


def test_simulate_warns_a_what_if_schedule_over_the_device_memory(tmp_path: Path) -> None:
    """simulate --schedule gpipe of a 1F1B plan holds every micro-batch: over the cluster's
    device memory, the text names the devices and the schedule planned for; the planned
    schedule within it says nothing."""
    from onnx_partition.cli.summary.simulate import format_simulation

    model = save(CHAIN, tmp_path / "chain.onnx")
    out = tmp_path / "plan"
    partition(model, 2, out, batch_size=4, mode="train", schedule="1f1b", recompute="none",
              cluster=Cluster(devices_per_machine=2))
    body = json.loads((out / "plan.json").read_text())
    plan = read_plan(out)
    planned, _ = simulate_plan(plan)
    gpipe, _ = simulate_plan(plan, schedule="gpipe")
    low, high = max(planned.peak_memory_bytes.values()), max(gpipe.peak_memory_bytes.values())
    assert low < high
    body["cluster"]["memory_gb"] = (low + high) / 2e9
    (out / "plan.json").write_text(json.dumps(body))
    plan = read_plan(out)
    assert "warning" not in format_simulation(plan, simulate_plan(plan)[0])
    text = format_simulation(plan, simulate_plan(plan, schedule="gpipe")[0])
    warning = [line for line in text.splitlines() if line.startswith("warning:")]
    over = [dev for dev, peak in gpipe.peak_memory_bytes.items() if peak > (low + high) / 2]
    assert len(warning) == 1 and warning[0].count(" replica ") == len(over) >= 1
    assert "under gpipe:" in warning[0] and warning[0].endswith("the plan was made for 1f1b")
