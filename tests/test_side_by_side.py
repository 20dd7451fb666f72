"""A train costs file's ``settings.side_by_side`` (cost/profile/side_by_side.py): a CPU plan
whose stages run as two or more processes on one machine is priced with each node's forward
and backward scaled by it (plan.json's ``compute_scale``); a one-device plan, a costs file
without it and a CUDA costs file price as measured."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from onnx_partition import export
from onnx_partition.calibrate.recut import calibrate_plan
from onnx_partition.cost.annotate import write_costs
from onnx_partition.cost.cluster import Cluster
from onnx_partition.cost.costs_file import provenance
from onnx_partition.cost.profile.side_by_side import cpus
from onnx_partition.cost.profile.torch_ops import profile_train
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.plan import Plan, read_plan

FACTORS = {"forward": 1.25, "backward": 1.5}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                              torch.nn.ReLU(), torch.nn.Linear(8, 8))
    return export(net, (torch.randn(2, 8),), tmp_path_factory.mktemp("sbs") / "net.onnx")


def costs_file(model: Path, out: Path, side: Any = None, device: str = "cpu") -> Path:
    """Every compute node 1 ms forward, 2 ms backward (half of it the input gradient)."""
    graph = load(model, batch_size=2)
    nodes = {graph.nodes[g].key: {"forward_ms": 1.0, "backward_ms": 2.0,
                                  "backward_input_ms": 1.0, "backward_weight_ms": 1.0}
             for g in graph.compute_nodes}
    settings = {"mode": "train"} | ({"side_by_side": side} if side is not None else {})
    write_costs(out, nodes, device=device, source="profile --mode train", mode="train",
                settings=settings, **provenance(graph, device))
    return out


def totals(plan: Plan) -> tuple[float, float]:
    stages = [s.predicted for s in plan.stages if s.predicted]
    return (sum(p.forward_ms or 0.0 for p in stages), sum(p.backward_ms or 0.0 for p in stages))


def plan_of(model: Path, costs: Path, out: Path, stages: int = 2, **options: Any) -> Plan:
    return partition(model, stages, out, costs=costs, mode="train", check=False,
                     schedule="1f1b", **options)


def test_a_two_stage_plan_is_priced_beside_the_other_stage(model: Path, tmp_path: Path) -> None:
    plain = plan_of(model, costs_file(model, tmp_path / "plain.json"), tmp_path / "a")
    scaled = plan_of(model, costs_file(model, tmp_path / "side.json", FACTORS), tmp_path / "b")
    fwd, bwd = totals(plain)
    computed = len(load(model, batch_size=2).compute_nodes)
    assert (fwd, bwd) == pytest.approx((computed * 1.0, computed * 2.0))
    assert totals(scaled) == pytest.approx((fwd * 1.25, bwd * 1.5), rel=1e-9)
    assert "compute_scale" not in plain.extra
    shared = scaled.extra["compute_scale"]
    assert (shared["forward"], shared["backward"]) == (1.25, 1.5) and "why" in shared
    # the input gradient (what zero-bubble schedules split off) scales with the backward
    grad_in = scaled.simulator_costs.get("backward_input_ms")
    if grad_in is not None:
        assert sum(grad_in) == pytest.approx(bwd * 1.5 / 2, rel=1e-6)


def test_a_one_device_plan_is_priced_as_measured(model: Path, tmp_path: Path) -> None:
    plain = plan_of(model, costs_file(model, tmp_path / "plain.json"), tmp_path / "a", 1)
    alone = plan_of(model, costs_file(model, tmp_path / "side.json", FACTORS), tmp_path / "b", 1)
    assert totals(alone) == totals(plain) and "compute_scale" not in alone.extra


def test_a_cpu_cluster_scales_by_its_machines_devices(model: Path, tmp_path: Path) -> None:
    side = costs_file(model, tmp_path / "side.json", FACTORS)
    shared = Cluster(machines=1, devices_per_machine=2, kind="cpu")
    apart = Cluster(machines=2, devices_per_machine=1, kind="cpu")
    on_one = partition(model, None, tmp_path / "a", costs=side, cluster=shared, mode="train",
                       check=False)
    on_two = partition(model, None, tmp_path / "b", costs=side, cluster=apart, mode="train",
                       check=False)
    assert on_one.extra["compute_scale"]["forward"] == 1.25
    assert "compute_scale" not in on_two.extra


def test_skipped_cuda_or_bad_figures(model: Path, tmp_path: Path) -> None:
    plain = totals(plan_of(model, costs_file(model, tmp_path / "plain.json"), tmp_path / "a"))
    skipped = costs_file(model, tmp_path / "skip.json", {"skipped": "1 CPU"})
    assert totals(plan_of(model, skipped, tmp_path / "b")) == plain
    gpu = costs_file(model, tmp_path / "gpu.json", FACTORS, device="cuda:0")
    assert "compute_scale" not in plan_of(model, gpu, tmp_path / "c").extra
    for bad in ({"forward": 0.0, "backward": 1.0}, {"forward": "x", "backward": 1.0},
                {"forward": 1.0}):
        with pytest.raises(PartitionError, match="side_by_side"):
            plan_of(model, costs_file(model, tmp_path / "bad.json", bad), tmp_path / "d")


def test_the_co_run_measures_finite_factors(model: Path) -> None:
    measured = profile_train(load(model, batch_size=2), model.with_suffix(".pt2"), repeats=2,
                             warmup=1, engine=False)
    side = measured.settings["side_by_side"]
    assert isinstance(side, dict)
    if cpus() < 2:
        assert "skipped" in side
        return
    assert side["processes"] == 2
    for key in ("forward", "backward"):
        assert math.isfinite(side[key]) and side[key] >= 1.0
        assert math.isfinite(side["measured"][key]) and side["measured"][key] > 0
    assert set(side["cpu_ms"]) == {"alone-tight", "alone-interleaved", "together-tight",
                                   "together-interleaved"}


def test_profile_plan_replaces_the_scaled_times_once(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "plan"
    plan_of(model, costs_file(model, tmp_path / "side.json", FACTORS), folder)
    before = read_plan(folder)
    priced = [(s.predicted.forward_ms or 0.0) + (s.predicted.backward_ms or 0.0)
              for s in before.stages if s.predicted]
    calibrate_plan(folder, rounds=1, repeats=2, warmup=0)
    plan = read_plan(folder)
    measured = plan.extra["calibrated"]["rounds"][0]
    # the round's "as priced" is the plan's scaled price; the plan's times are measured, those
    # of its own run in the engine (processes side by side already), with no compute_scale
    # left to apply
    assert measured["priced_ms"] == pytest.approx(priced, rel=1e-6)
    run = plan.extra["calibrated"]["engine_run"]
    assert [s.predicted.forward_ms for s in plan.stages] == run["forward_ms"]
    assert all(0 < (s.predicted.backward_ms or 0) <= b
               for s, b in zip(plan.stages, run["backward_ms"], strict=True))
    assert "compute_scale" not in plan.extra
