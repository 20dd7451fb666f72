"""A train costs file's ``settings.cold_cache`` (cost/profile/cold_cache.py): a CPU plan whose
stages run as two or more processes on one machine is priced with each node's forward and
backward scaled by it, times ``side_by_side`` where both were measured (plan.json's
``compute_scale``, with its parts); the eviction buffer is twice the largest cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from onnx_partition import export
from onnx_partition.cost.annotate import write_costs
from onnx_partition.cost.costs_file import provenance
from onnx_partition.cost.profile.cold_cache import (
    DEFAULT_CACHE_BYTES,
    eviction_bytes,
    measure_cold_cache,
)
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.plan import Plan


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    return export(net, (torch.randn(2, 8),), tmp_path_factory.mktemp("cold") / "net.onnx")


def plan_with(model: Path, tmp_path: Path, stages: int = 2, **settings: object) -> Plan:
    """The 2-stage train plan of ``model`` priced by a costs file of every compute node 1 ms
    forward and 2 ms backward, with ``settings``."""
    graph = load(model, batch_size=2)
    nodes = {graph.nodes[g].key: {"forward_ms": 1.0, "backward_ms": 2.0,
                                  "backward_input_ms": 1.0, "backward_weight_ms": 1.0}
             for g in graph.compute_nodes}
    tmp_path.mkdir(parents=True, exist_ok=True)
    costs = tmp_path / "costs.json"
    write_costs(costs, nodes, device="cpu", source="profile --mode train", mode="train",
                settings={"mode": "train", **settings}, **provenance(graph, "cpu"))
    return partition(model, stages, tmp_path / "plan", costs=costs, mode="train", check=False,
                     schedule="1f1b")


def totals(plan: Plan) -> tuple[float, float]:
    stages = [s.predicted for s in plan.stages if s.predicted]
    return (sum(p.forward_ms or 0.0 for p in stages), sum(p.backward_ms or 0.0 for p in stages))


def test_cold_caches_scale_a_pipeline_and_multiply_the_co_run(model: Path,
                                                               tmp_path: Path) -> None:
    computed = len(load(model, batch_size=2).compute_nodes)
    cold = {"forward": 1.2, "backward": 1.1}
    alone = plan_with(model, tmp_path / "a", cold_cache=cold)
    assert totals(alone) == pytest.approx((computed * 1.2, computed * 2.2), rel=1e-9)
    assert alone.extra["compute_scale"]["parts"] == {"cold_cache": cold}
    both = plan_with(model, tmp_path / "b", cold_cache=cold,
                     side_by_side={"forward": 1.5, "backward": 2.0})
    shared = both.extra["compute_scale"]
    assert (shared["forward"], shared["backward"]) == pytest.approx((1.8, 2.2))
    assert totals(both) == pytest.approx((computed * 1.8, computed * 4.4), rel=1e-9)
    assert "cold caches" in shared["why"] and "beside a second process" in shared["why"]
    # one process waits for nobody: priced as measured
    one = plan_with(model, tmp_path / "c", 1, cold_cache=cold)
    assert "compute_scale" not in one.extra
    assert totals(one) == pytest.approx((computed * 1.0, computed * 2.0))
    with pytest.raises(PartitionError, match=r"cold_cache\.backward"):
        plan_with(model, tmp_path / "d", cold_cache={"forward": 1.0, "backward": -1.0})


def test_eviction_is_twice_the_largest_cache(tmp_path: Path) -> None:
    for index, size in enumerate(("32K", "1024K", "32768K\n", "junk")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size)
    assert eviction_bytes(tmp_path) == 2 * 32768 * 1024
    assert eviction_bytes(tmp_path / "missing") == 2 * DEFAULT_CACHE_BYTES


def test_the_measure_runs_each_pass_warm_and_cold_in_turn() -> None:
    calls: list[str] = []

    def forward() -> int:
        calls.append("F")
        return len(calls)

    def backward(token: int) -> None:
        calls.append(f"B{token}")

    measured = measure_cold_cache(forward, backward, repeats=3, warmup=1, evict=1024)
    assert len(calls) == 2 * 2 * (3 + 1)
    assert all(calls[i + 1] == f"B{i + 1}" for i in range(0, len(calls), 2))
    assert measured["evict_bytes"] == 1024 and set(measured["cpu_ms"]) == {"warm", "cold"}
    for key in ("forward", "backward"):
        assert math.isfinite(measured[key]) and measured[key] >= 1.0
