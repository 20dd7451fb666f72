"""``profile --mode train`` (cost/profile/torch_ops.py): every torch op's forward and backward in
torch eager, calibrated to the whole program, keyed by ONNX node; a train costs file prices a
train plan, is refused for another model and warned about at another batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import one_error

from onnx_partition import export
from onnx_partition.cost.profile.torch_ops import profile_train_to_file
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.report.lines import priced_by


class Mlp(torch.nn.Module):
    """Three identical Linear + GELU + LayerNorm blocks (identical ops: measured once)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
            for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(Mlp(16), (torch.randn(2, 16),), tmp_path_factory.mktemp("mlp") / "mlp.onnx")


@pytest.fixture(scope="module")
def costs(mlp: Path) -> Path:
    out = mlp.parent / "train-costs.json"
    profile_train_to_file(mlp, out, batch_size=4, repeats=3, warmup=1)
    return out


def test_every_compute_node_priced_and_calibrated_to_the_whole(mlp: Path, costs: Path) -> None:
    body = json.loads(costs.read_text())
    graph = load(mlp, batch_size=4)
    assert set(body["nodes"]) == {graph.nodes[g].key for g in graph.compute_nodes}
    assert body["mode"] == "train" and body["source"] == "profile --mode train"
    assert body["executor"] == f"torch {torch.__version__} eager"
    assert body["batch_size"] == 4 and body["device_kind"] == "cpu"
    assert body["fingerprint"].startswith("sha256:")
    settings = body["settings"]
    forward = sum(n["forward_ms"] for n in body["nodes"].values())
    backward = sum(n["backward_ms"] for n in body["nodes"].values())
    assert forward == pytest.approx(settings["whole_forward_ms"], rel=1e-3, abs=1e-5)
    assert backward == pytest.approx(settings["whole_backward_ms"], rel=1e-3, abs=1e-5)
    assert backward > 0
    side = settings["side_by_side"]  # measured beside a co-runner process, or said why not
    assert "skipped" in side or (side["forward"] > 0 and side["backward"] > 0)
    # one unit per FX op: linear, gelu, layer_norm times 3, each signature measured once (the
    # first linear's input needs no gradient, the others' do: 4 signatures)
    assert body["unique_signatures"] == 4 and body["reused"] == 5
    assert sum(1 for n in body["nodes"].values() if n["forward_ms"] > 0) <= 9
    # the backward split into the input-gradient and weight-gradient passes: they add up; the
    # GELUs read no weights (all input gradient), the Linears and LayerNorms both
    for key, n in body["nodes"].items():
        assert n["backward_input_ms"] + n["backward_weight_ms"] == pytest.approx(
            n["backward_ms"], abs=2e-6), key
        assert n["backward_input_ms"] >= 0 and n["backward_weight_ms"] >= -1e-6
    gelu = [n for k, n in body["nodes"].items() if "gelu" in k.lower() and n["backward_ms"] > 0]
    assert gelu and all(n["backward_weight_ms"] <= 1e-6 for n in gelu)
    weighted = [n for n in body["nodes"].values()
                if n["backward_weight_ms"] > 0 and n["backward_input_ms"] > 0]
    assert len(weighted) >= 2


def test_a_train_costs_file_prices_a_train_plan(mlp: Path, costs: Path,
                                                 tmp_path: Path) -> None:
    plan = partition(mlp, 2, tmp_path / "plan", costs=costs, mode="train", check=False)
    assert plan.extra["costs"]["backward"] == "measured"
    body = json.loads(costs.read_text())
    per_stage = [(s.predicted.forward_ms, s.predicted.backward_ms) for s in plan.stages
                 if s.predicted]
    # two stages, two processes on this machine: priced as the profile measured them side by
    # side (settings.side_by_side; none on a 1-CPU machine) and from cold caches
    # (settings.cold_cache, measured on every CPU)
    side = body["settings"]["side_by_side"]
    cold = body["settings"]["cold_cache"]
    scale = plan.extra["compute_scale"]
    for key in ("forward", "backward"):
        assert scale[key] == pytest.approx(
            cold[key] * (1.0 if "skipped" in side else side[key]), rel=1e-9)
    assert sum(f for f, _ in per_stage) == pytest.approx(
        body["settings"]["whole_forward_ms"] * scale["forward"], rel=1e-3, abs=1e-5)
    assert sum(b for _, b in per_stage) == pytest.approx(
        body["settings"]["whole_backward_ms"] * scale["backward"], rel=1e-3, abs=1e-5)
    assert "backward estimated" not in priced_by(plan)
    assert plan.extra["schedule"] in ("1f1b", "zb-h1") and plan.extra["optimizer"] == "adamw"
    for stage in plan.stages:
        p = stage.predicted
        assert p is not None and p.inflight is not None
        assert p.compute_ms == pytest.approx((p.forward_ms or 0) + (p.backward_ms or 0),
                                             abs=1e-5)
        assert p.memory_bytes == ((p.weights_bytes or 0) + (p.grad_bytes or 0)
                                  + (p.optimizer_bytes or 0) + p.inflight
                                  * (p.activation_bytes or 0) + (p.buffer_bytes or 0))
    analytic = partition(mlp, 2, tmp_path / "plan2", batch_size=4, mode="train", check=False)
    assert analytic.extra["costs"]["backward"] == "estimated"
    assert "backward estimated" in priced_by(analytic)


def test_a_train_costs_file_of_another_model_is_refused(costs: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    other = export(Mlp(8), (torch.randn(2, 8),), tmp_path / "other.onnx")
    with pytest.raises(PartitionError, match="another graph"):
        partition(other, 2, tmp_path / "plan", costs=costs, batch_size=4, mode="train")


def test_a_train_costs_file_of_another_batch_is_warned(mlp: Path, costs: Path,
                                                        tmp_path: Path) -> None:
    plan = partition(mlp, 2, tmp_path / "plan", costs=costs, batch_size=8, mode="train",
                     check=False)
    notes = plan.extra["costs"]["check"]["notes"]
    assert any("measured at batch size 4, this plan is for 8" in n for n in notes)


def test_a_train_costs_file_pricing_an_inference_plan_is_warned(
        mlp: Path, costs: Path, tmp_path: Path) -> None:
    plan = partition(mlp, 2, tmp_path / "plan", costs=costs, check=False)
    assert any("measured for training" in n for n in plan.extra["costs"]["check"]["notes"])
    assert "optimizer" not in plan.extra and all(
        s.predicted and s.predicted.forward_ms is None for s in plan.stages)


def test_profile_train_without_a_program_is_a_one_line_error(
        mlp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    alone = tmp_path / "alone.onnx"
    alone.write_bytes(mlp.read_bytes())
    one_error(capsys, ["profile", alone, "--mode", "train", "-o", tmp_path / "c.json"],
              "alone.pt2")
    assert not (tmp_path / "c.json").exists()
    one_error(capsys, ["profile", mlp, "--mode", "train", "-o", mlp.with_suffix(".pt2")],
              "would overwrite the model")
