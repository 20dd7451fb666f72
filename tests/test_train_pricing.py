"""A train plan for this CPU is priced by measuring it by default (issue 33 item 5): which
requests measure (:func:`onnx_partition.request.resolve.resolve`), and, with the profiler
standing in for ``profile --mode train`` (a minute or two a model), that the first plan
profiles once into the cache and the next reads it back (the same plan), that the summary says
which priced the plan, and that ``--analytic`` keeps the roofline. The suite prices train
plans analytically (conftest); these tests unset that."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import annotate, write_costs
from onnx_partition.cost.costs_file import provenance
from onnx_partition.cost.profile import torch_ops
from onnx_partition.cost.profile.cache import CACHE_ENV
from onnx_partition.cost.profile.train_cache import PRICING_ENV, profile_key, profile_path
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.request.partition import CostSource, DeviceOptions, PartitionOptions
from onnx_partition.request.resolve import resolve


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The measured default back on (conftest turns it off), the profile cache in tmp."""
    monkeypatch.delenv(PRICING_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16), torch.nn.GELU())
    return export(model, (torch.randn(2, 16),), tmp_path_factory.mktemp("mlp") / "mlp.onnx")


def _options(model: Path, **given: Any) -> PartitionOptions:
    devices = given.pop("devices", DeviceOptions())
    return PartitionOptions(model, model.parent / "plan", 2, devices=devices,
                            mode=given.pop("mode", "train"), **given)


def test_which_train_plans_are_measured(measured, mlp, tmp_path, monkeypatch):
    assert resolve(_options(mlp)).costs.measure
    assert resolve(_options(mlp, devices=DeviceOptions(devices=2))).costs.measure
    roofline = [_options(mlp, analytic=True), _options(mlp, mode="infer"),
                _options(mlp, devices=DeviceOptions(gpu="a100-80gb")),
                _options(mlp, devices=DeviceOptions(cpu_tflops=0.1)),
                _options(mlp, devices=DeviceOptions(devices=2, machines=2)),
                _options(mlp, costs=CostSource(tmp_path / "c.json"))]
    assert [resolve(o).costs.measure for o in roofline] == [False] * len(roofline)
    alone = tmp_path / "alone.onnx"  # no program beside it: nothing to measure
    alone.write_bytes(mlp.read_bytes())
    assert not resolve(_options(alone)).costs.measure
    monkeypatch.setenv(PRICING_ENV, "analytic")
    assert not resolve(_options(mlp)).costs.measure
    monkeypatch.setenv(PRICING_ENV, "guessed")
    with pytest.raises(PartitionError, match="must be measured or analytic, got 'guessed'"):
        resolve(_options(mlp))
    monkeypatch.delenv(PRICING_ENV)
    with pytest.raises(PartitionError, match="--analytic prices by the roofline"):
        resolve(_options(mlp, analytic=True, costs=CostSource(tmp_path / "c.json")))


def test_the_key_names_what_shapes_the_times(mlp, tmp_path):
    key = profile_key(mlp, input_shapes=None, batch_size=2, precision="fp32")
    assert profile_path(key, tmp_path) == profile_path(dict(key), tmp_path)
    others = [profile_key(mlp, input_shapes=None, batch_size=4, precision="fp32"),
              profile_key(mlp, input_shapes=None, batch_size=2, precision="bf16"),
              {**key, "cpu": "another CPU"}, {**key, "program": "0" * 64}]
    paths = {profile_path(k, tmp_path) for k in [key, *others]}
    assert len(paths) == 5 and all(p.parent == tmp_path for p in paths)


def _stand_in(calls: list[dict[str, Any]]) -> Any:
    """A profiler writing a train costs file of twice the roofline's times, as fast as it is."""

    def profile(model: Path, output: Path, **options: Any) -> None:
        calls.append(options)
        graph = load(model, batch_size=options["batch_size"],
                     input_shapes=options["input_shapes"])
        costs = annotate(graph, device=DeviceSpec.cpu())
        nodes = {graph.nodes[g].key: {"forward_ms": 2 * costs.forward_ms[g],
                                      "backward_ms": 2 * costs.backward_ms[g]}
                 for g in graph.compute_nodes}
        write_costs(Path(output), nodes, device="cpu", source="profile --mode train",
                    mode="train",
                    **provenance(graph, "cpu"))

    return profile


def test_the_default_profiles_once_and_reads_the_cache_after(measured, mlp, tmp_path,
                                                             monkeypatch, capsys):
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(torch_ops, "profile_train_to_file", _stand_in(calls))
    argv = ["partition", str(mlp), "--mode", "train", "--stages", "2", "--batch-size", "2",
            "--microbatches", "4", "--exact-budget", "0", "--order", "topo"]
    plans = []
    for i, extra in enumerate([[], [], ["--analytic"]]):
        out = tmp_path / f"plan{i}"
        assert main([*argv, *extra, "-o", str(out)]) == 0
        lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("priced by")]
        plans.append((json.loads((out / "plan.json").read_text()), lines[0]))
    assert len(calls) == 1 and calls[0]["threads"] == 1 and calls[0]["batch_size"] == 2
    (first, said), (again, said_again), (roofline, said_roofline) = plans
    cached = next(measured.glob("train-*.json"))
    model = {k: first["device_model"][k] for k in ("source", "file", "measured_on", "profiled")}
    assert model == {"source": "costs", "file": str(cached), "measured_on": "cpu",
                     "profiled": "profiled now and cached"}
    assert said.startswith(f"priced by: measured on this CPU (profiled now and cached {cached}")
    assert again["device_model"]["profiled"] == "cached profile"
    assert said_again.startswith(f"priced by: measured on this CPU (cached profile {cached}")
    assert again["predicted"] == first["predicted"]
    assert roofline["device_model"]["source"] == "analytic"
    assert said_roofline.startswith("priced by: analytic roofline")
    # the plan is priced by the profile's times (the stand-in's: twice DeviceSpec.cpu()'s)
    graph = load(mlp, batch_size=2)
    expected = 2 * sum(annotate(graph, device=DeviceSpec.cpu()).forward_ms)
    assert sum(first["simulator_costs"]["forward_ms"]) == pytest.approx(expected, rel=1e-3)
