"""The training engine's own work priced beside the stages (cost/engine_price.py): the per-step term
(optimizer step and barriers) in the simulator, exact on a tiny schedule; the analytic and the
measured per-stage figures; the hop link's fit; and plan.json's ``step_ms``, ``hop_bytes`` and
``engine_costs`` written by ``partition --mode train`` and read back by the simulation, inference
plans left alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from support.engine import probed_engine, write_train_costs

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.cost.annotate import load_costs
from onnx_partition.cost.engine_price import (
    BARRIERS_PER_STEP,
    SPLIT_CALL_MS,
    analytic_accumulate_ms,
    analytic_step_ms,
    fit_link,
    hop_ms,
    measured_step_ms,
    price_engine,
    split_groups,
    split_ms,
    tied_bytes,
)
from onnx_partition.cost.profile.engine import measure_engine
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.pipeline.schedules import Action, Kind, build
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import read_plan
from onnx_partition.plan.contracts import COSTS_FORMAT
from onnx_partition.runtime.train.passes import split_call_ms


def _two_stages(step: tuple[float, float]) -> PipelineCosts:
    return PipelineCosts([StageCosts(1.0, 2.0, step_ms=step[0]),
                          StageCosts(1.0, 2.0, step_ms=step[1])], [0.5])


def test_a_step_term_ends_the_iteration_after_the_last_device_by_hand() -> None:
    """2 stages, 1F1B, 2 micro-batches, F 1 ms, B 2 ms, sends 0.5 ms. Stage 0 runs F0 F1 B0 B1,
    stage 1 F0 B0 F1 B1: s0 F0 0-1, F1 1-2; s1 F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5;
    s0 B0 5-7 (s1 B0 + send), B1 8-10. The last device is free at 10; then the slowest
    stage's per-step work, 5 ms: 15."""
    sched = build("1f1b", [1, 1], 2)
    assert sched[(0, 0)] == [Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 0),
                             Action(0, Kind.B, 1)]
    assert simulate(sched, _two_stages((0.0, 0.0))).iteration_ms == 10.0
    result = simulate(sched, _two_stages((3.0, 5.0)))
    assert result.iteration_ms == 15.0
    assert result.busy_ms == {(0, 0): 6.0, (1, 0): 6.0}  # compute only
    # accumulation: micro-batch 1's B on each stage takes 1 ms more (micro-batch 0 sets the
    # gradients): s1 B1 5.5-8.5, s0 B1 9-12; then the step term: 17
    acc = PipelineCosts([StageCosts(1.0, 2.0, step_ms=3.0, accumulate_ms=1.0),
                         StageCosts(1.0, 2.0, step_ms=5.0, accumulate_ms=1.0)], [0.5])
    result = simulate(sched, acc)
    assert result.iteration_ms == 17.0 and result.busy_ms == {(0, 0): 7.0, (1, 0): 7.0}
    # forward streaming (inference) has no optimizer step
    infer = build("infer", [1, 1], 2)
    assert simulate(infer, _two_stages((3.0, 5.0))).iteration_ms == \
        simulate(infer, _two_stages((0.0, 0.0))).iteration_ms


def test_analytic_step_is_bytes_moved_over_bandwidth_plus_barriers() -> None:
    # 1e6 fp32 parameters: AdamW moves 28 MB, at 10 GB/s 2.8 ms; SGD 12 MB, 1.2 ms
    assert analytic_step_ms([4e6, 0.0], "adamw", 10.0, 0.02) == pytest.approx(
        [2.8 + BARRIERS_PER_STEP * 0.02, BARRIERS_PER_STEP * 0.02])
    assert analytic_step_ms([4e6], "sgd", 10.0, 0.0) == pytest.approx([1.2])
    assert analytic_accumulate_ms([4e6, 8e6], 10.0) == pytest.approx([1.2, 2.4])
    with pytest.raises(PartitionError, match="unknown optimizer"):
        analytic_step_ms([1.0], "lamb", 10.0, 0.0)


def test_measured_step_scales_the_programs_step_by_parameter_bytes() -> None:
    engine = {"parameter_bytes": 100, "optimizer_ms": {"adamw": 10.0, "sgd": 4.0},
              "barrier_ms": 0.5}
    assert measured_step_ms([25.0, 75.0], "adamw", engine) == pytest.approx([3.5, 8.5])
    assert measured_step_ms([25.0, 75.0], "sgd", engine) == pytest.approx([2.0, 4.0])
    assert measured_step_ms([1.0], "adamw", {"optimizer_ms": {}}) is None


def test_hops_are_piecewise_linear_between_measured_sizes() -> None:
    sizes, times = [1000.0, 3000.0, 5000.0], [0.1, 0.3, 0.7]
    assert hop_ms(500.0, sizes, times) == pytest.approx(0.1)  # below: the smallest's time
    assert hop_ms(2000.0, sizes, times) == pytest.approx(0.2)
    assert hop_ms(4000.0, sizes, times) == pytest.approx(0.5)
    assert hop_ms(7000.0, sizes, times) == pytest.approx(1.1)  # beyond: the last slope
    assert fit_link(sizes, times) == (pytest.approx(0.1), pytest.approx(2000 / 0.4 / 1e6))
    assert fit_link([1.0, 2.0], [0.3, 0.3]) == (pytest.approx(0.3), 0.0)  # flat: unlimited
    # a small payload timed slower than a larger one takes the larger one's time
    assert hop_ms(1000.0, [1000.0, 2000.0, 3000.0], [0.9, 0.2, 0.4]) == pytest.approx(0.2)
    assert hop_ms(2500.0, [1000.0, 2000.0, 3000.0], [0.9, 0.2, 0.4]) == pytest.approx(0.3)
    with pytest.raises(PartitionError, match="as many times as sizes"):
        hop_ms(1.0, [], [])


def test_tied_bytes_are_the_trainable_parameters_another_stage_holds() -> None:
    stages = [["wte", "w0", "const"], ["w1", "wte", "const"], ["w2"]]
    sizes = {"wte": 100.0, "w0": 1.0, "w1": 2.0, "w2": 3.0, "const": 7.0}
    assert tied_bytes(stages, sizes, {"wte", "w0", "w1", "w2"}) == [100.0, 100.0, 0.0]
    assert tied_bytes(stages, sizes, None) == [0.0, 0.0, 0.0]  # no program: nothing trains


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                          torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                          torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(_Mlp(), (torch.randn(2, 32),), tmp_path_factory.mktemp("mlp") / "mlp.onnx")


def test_an_analytic_train_plan_carries_a_nonzero_step_term(mlp: Path, tmp_path: Path) -> None:
    plan = partition(mlp, 2, tmp_path / "plan", mode="train", check=False, batch_size=2)
    sim = plan.simulator_costs
    assert len(sim["step_ms"]) == 2 and all(x > 0 for x in sim["step_ms"])
    assert len(sim["hop_bytes"]) == 1 and sim["hop_bytes"][0] > 0
    assert plan.extra["engine_costs"]["step_ms"].startswith("analytic")
    assert len(sim["accumulate_ms"]) == 2 and all(x > 0 for x in sim["accumulate_ms"])
    # read back from plan.json: the simulation adds the slowest stage's step once
    back = read_plan(tmp_path / "plan")
    assert back.simulator_costs["step_ms"] == sim["step_ms"]
    with_step = simulate_plan(back)[0].iteration_ms
    bare = copy.deepcopy(back)
    bare.simulator_costs.pop("step_ms")
    assert with_step == pytest.approx(simulate_plan(bare)[0].iteration_ms
                                      + max(sim["step_ms"]), abs=1e-9)
    assert back.predicted["iteration_ms"] == pytest.approx(with_step, abs=1e-5)
    # inference plans: no engine terms
    infer = partition(mlp, 2, tmp_path / "infer", check=False, batch_size=2)
    assert "step_ms" not in infer.simulator_costs and "engine_costs" not in infer.extra


def test_simulate_at_other_rows_keeps_the_per_step_work(mlp: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """``simulate --batch-size`` at twice a train plan's rows: the costs at those rows
    (compute, activations, hops doubled), the optimizer step and barriers as planned; an
    iteration below twice the plan's by at least the step term."""
    partition(mlp, 2, tmp_path / "plan", mode="train", check=False, batch_size=2)
    plan = read_plan(tmp_path / "plan")
    assert main(["simulate", str(tmp_path / "plan"), "--json", "--batch-size", "4"]) == 0
    doubled = json.loads(capsys.readouterr().out)
    expected = simulate_plan(plan, rows_scale=2.0)[0]
    assert doubled["iteration_ms"] == pytest.approx(expected.iteration_ms, abs=1e-6)
    assert doubled["scaled_from_batch_size"] == 2 and doubled["rows"] == 4 * plan.microbatches
    step = max(plan.simulator_costs["step_ms"])
    assert doubled["iteration_ms"] <= 2 * plan.predicted["iteration_ms"] - step + 1e-5
    bare = copy.deepcopy(plan)
    bare.simulator_costs.pop("step_ms")
    assert expected.iteration_ms == pytest.approx(
        simulate_plan(bare, rows_scale=2.0)[0].iteration_ms + step, abs=1e-9)


def test_a_costs_files_engine_prices_step_and_hops(mlp: Path, tmp_path: Path) -> None:
    """A costs file's measured ``engine`` (here written by hand, as profile --mode train writes
    it) gives each stage its share of the optimizer step and each hop the fitted link."""
    plan = partition(mlp, 2, tmp_path / "plan", mode="train", check=False, batch_size=2)
    nodes = {}
    for stage in plan.stages:
        for key in stage.nodes:
            nodes[key] = {"forward_ms": 0.1, "backward_ms": 0.2}
    engine = {"parameter_bytes": 1000, "optimizer_ms": {"adamw": 2.0, "sgd": 1.0},
              "accumulate_ms": 0.5,
              "barrier_ms": 0.25, "link": {"latency_ms": 0.5, "bandwidth_gbps": 1.0,
                                           "sizes": [1, 1_000_001], "one_way_ms": [0.5, 1.5]}}
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": COSTS_FORMAT, "unit": "ms",
                                 "mode": "train", "device": "cpu", "engine": engine,
                                 "nodes": nodes}))
    loaded = load_costs(costs)
    assert loaded.body["engine"] == engine
    priced = copy.deepcopy(plan)
    price_engine(priced, costs=loaded, device=None)
    weights = [float(s.predicted.weights_bytes or 0) for s in priced.stages if s.predicted]
    assert priced.simulator_costs["step_ms"] == pytest.approx(
        [2.0 * w / 1000 + BARRIERS_PER_STEP * 0.25 for w in weights], abs=1e-6)
    assert priced.simulator_costs["accumulate_ms"] == pytest.approx(
        [0.5 * w / 1000 for w in weights], abs=1e-6)
    hop = priced.simulator_costs["hop_bytes"][0]
    assert priced.simulator_costs["send_ms"] == pytest.approx([0.5 + (hop - 1) / 1e6],
                                                              abs=1e-6)
    assert priced.extra["engine_costs"]["step_ms"].startswith("measured")
    # a stage holding 1 MB tied to another's adds one hop of it: 0.5 + 1e6 / 1e6 ms
    tied = copy.deepcopy(plan)
    price_engine(tied, costs=loaded, device=None, tied=[1_000_001.0, 0.0])
    assert [a - b for a, b in zip(tied.simulator_costs["step_ms"],
                                  priced.simulator_costs["step_ms"])] == pytest.approx(
        [1.5, 0.0], abs=1e-6)
    assert priced.extra["engine_costs"]["send_ms"].startswith("measured")


def test_the_split_overhead_goes_half_to_i_and_half_to_w() -> None:
    """``split_ms`` lengthens ZB-H1's ``I`` and ``W`` by half each, not 1F1B's ``B``; one stage,
    one micro-batch: F (1) + I (1.5 + 0.25) + W (0.5 + 0.25) = 3.5 ms."""
    stage = StageCosts(1.0, 2.0, backward_input_ms=1.5, split_ms=0.5)
    assert (stage.duration(Kind.B), stage.duration(Kind.I), stage.duration(Kind.W)) == (
        2.0, 1.75, 0.75)
    one = PipelineCosts([stage], [])
    assert simulate(build("zb-h1", [1], 1), one).iteration_ms == pytest.approx(3.5)
    assert simulate(build("1f1b", [1], 1), one).iteration_ms == pytest.approx(3.0)
    assert one.at_rows(2.0).stages[0].split_ms == 0.5  # per call, not per row


def test_split_groups_and_per_stage_overhead() -> None:
    assert [split_groups(n) for n in (0, 1, 2, 5, 6)] == [0, 1, 1, 3, 3]
    assert split_ms([4, 4, 1, 0], 0.5) == [0.0, 1.0, 0.5, 0.0]  # the first stage: no I


def test_a_zb_h1_plan_prices_the_split_and_a_1f1b_plan_does_not(mlp: Path,
                                                                 tmp_path: Path) -> None:
    """Analytic: :data:`SPLIT_CALL_MS` per group; a costs file's ``split_call_ms`` where it
    measured one; read back by the simulation, which it lengthens."""
    zb = partition(mlp, 2, tmp_path / "zb", mode="train", check=False, batch_size=2,
                   schedule="zb-h1")
    got = zb.simulator_costs["split_ms"]
    assert len(got) == 2 and got[0] == 0.0 and got[1] > 0
    assert zb.extra["engine_costs"]["split_ms"].startswith("analytic")
    priced = copy.deepcopy(zb)
    price_engine(priced, costs=None, device=None, tensors=[4, 2])
    assert priced.simulator_costs["split_ms"] == pytest.approx([0.0, SPLIT_CALL_MS])
    nodes = {key: {"forward_ms": 0.1, "backward_ms": 0.2} for st in zb.stages for key in st.nodes}
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": COSTS_FORMAT, "unit": "ms", "mode": "train",
                                 "device": "cpu", "nodes": nodes,
                                 "engine": {"parameter_bytes": 1000, "split_call_ms": 0.25,
                                            "optimizer_ms": {"adamw": 2.0}}}))
    price_engine(priced, costs=load_costs(costs), device=None, tensors=[4, 6])
    assert priced.simulator_costs["split_ms"] == pytest.approx([0.0, 0.75])
    assert priced.extra["engine_costs"]["split_ms"].startswith("measured")
    back = read_plan(tmp_path / "zb")
    bare = copy.deepcopy(back)
    bare.simulator_costs.pop("split_ms")
    assert simulate_plan(back)[0].iteration_ms > simulate_plan(bare)[0].iteration_ms
    plain = partition(mlp, 2, tmp_path / "1f1b", mode="train", check=False, batch_size=2,
                      schedule="1f1b")
    assert "split_ms" not in plain.simulator_costs
    assert "split_ms" not in plain.extra["engine_costs"]


def test_measure_engine_keeps_the_probes_figures_with_the_hops() -> None:
    params = [torch.zeros(4, 4)]
    figures = {"action_ms": 0.25, "barrier_ms": 1.5, "hop_ms": 0.75, "source": "by hand"}
    # no hops measured (a GPU's costs): the probe, a CPU pipeline, is not run
    assert "probe" not in measure_engine(params, repeats=1, hops=False,
                                         probe=lambda link: pytest.fail("run without hops"))
    links = []
    got = measure_engine(params, repeats=1, probe=lambda link: links.append(link) or figures)
    # called with the link just measured: its hop_ms is what a hop adds to that link's
    assert got["probe"] == figures and links == [got["link"]]


def test_measure_engine_keeps_the_split_timers_figure() -> None:
    params = [torch.zeros(4, 4)]
    assert measure_engine(params, repeats=1, hops=False, split=lambda: 0.125)[
        "split_call_ms"] == 0.125
    assert measure_engine(params, repeats=1, hops=False, split=lambda: -1.0)[
        "split_call_ms"] == 0.0
    assert "split_call_ms" not in measure_engine(params, repeats=1, hops=False)
    got = split_call_ms(layers=2, repeats=2)
    assert got >= 0.0 and got == got  # a figure, never negative (no timing asserted)


def test_a_hybrid_train_plan_is_chosen_by_its_final_figure(mlp: Path, tmp_path: Path) -> None:
    """On a cluster, with a costs file whose probe prices the engine's work per action and per
    hop, 1F1B or the schedule chosen (ZB-H1 with its split backward): the iteration the planner
    chose the plan by is the one it prints, simulated from plan.json after ``price_engine``."""
    from onnx_partition.cost.cluster import Cluster

    plan = partition(mlp, 2, tmp_path / "plain", mode="train", check=False, batch_size=2)
    nodes = {key: {"forward_ms": 0.1, "backward_ms": 0.2}
             for stage in plan.stages for key in stage.nodes}
    costs = write_train_costs(tmp_path / "costs.json", probed_engine(), nodes)
    for stages, schedule in ((None, "1f1b"), (2, "1f1b"), (2, "auto")):
        hybrid = partition(mlp, stages, tmp_path / f"hybrid{stages}{schedule}", mode="train",
                           check=False, batch_size=2, costs=costs, schedule=schedule,
                           cluster=Cluster(1, 2, memory_gb=80.0, kind="cpu"))
        assert len(hybrid.stages) == (stages or len(hybrid.stages))
        chosen = min(v["iteration_ms"] for v in hybrid.extra["orderings"].values()
                     if "iteration_ms" in v)
        assert chosen == pytest.approx(hybrid.predicted["iteration_ms"], abs=1e-5)
