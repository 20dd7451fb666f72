"""Profiling costs on the device: costs.json contract, signature reuse, cache, devices.

Small hand-built models and few repeats keep this fast; no test asserts a timing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import COSTS_FORMAT, annotate, read_costs
from onnx_partition.cost.profile import (
    CACHE_ENV,
    ProfileResult,
    parse_device,
    profile_model,
    profile_to_file,
    save_profile,
)
from onnx_partition.cost.profile.cpu import FOLDED, _match_key
from onnx_partition.cost.profile.node_costs import SignatureTimes, calibrate
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def fast(graph: OpGraph, cache: Path, **kwargs: Any) -> ProfileResult:
    """A quick profile: few repeats (figures are not checked, only their bookkeeping)."""
    return profile_model(graph, cache_dir=cache, repeats=3, warmup=1, **kwargs)


def _init(name: str, shape: list[int], seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def _save(tmp: Path, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
          outputs: list[str], inits: list[onnx.TensorProto], name: str = "m.onnx",
          external: bool = False) -> Path:
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                               for o in outputs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp / name
    onnx.save_model(model, path, save_as_external_data=external, location=f"{name}.data",
                    size_threshold=0)
    return path


def blocks_model(tmp: Path, blocks: int = 6, width: int = 32) -> Path:
    """``blocks`` identical MatMul -> Add -> Relu blocks (different weights, same shapes)."""
    nodes, inits, x = [], [], "x"
    for b in range(blocks):
        inits += [_init(f"w{b}", [width, width], b), _init(f"b{b}", [width], 100 + b)]
        nodes += [helper.make_node("MatMul", [x, f"w{b}"], [f"m{b}"], name=f"mm{b}"),
                  helper.make_node("Add", [f"m{b}", f"b{b}"], [f"a{b}"], name=f"add{b}"),
                  helper.make_node("Relu", [f"a{b}"], [f"r{b}"], name=f"relu{b}")]
        x = f"r{b}"
    inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    return _save(tmp, nodes, [inp], [x], inits)


@pytest.fixture()
def blocks(tmp_path: Path) -> OpGraph:
    return load(blocks_model(tmp_path), batch_size=4)


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_costs_json_round_trip(blocks: OpGraph, cache: Path, tmp_path: Path) -> None:
    result = fast(blocks, cache)
    out = tmp_path / "out" / "costs.json"
    save_profile(result, out)
    body = json.loads(out.read_text())
    assert body["format"] == COSTS_FORMAT and body["unit"] == "ms" and body["device"] == "cpu"
    assert body["onnxruntime"] == ort.__version__ and body["settings"]["repeats"] == 3
    costs = read_costs(out)
    assert set(costs) == {n.key for n in blocks.nodes}
    for key, entry in costs.items():
        assert entry["forward_ms"] == pytest.approx(result.forward_ms[key], abs=1e-6)
        assert entry["backward_ms"] == pytest.approx(result.backward_ms[key], abs=1e-6)
    assert annotate(blocks, costs=out).measured == len(blocks.nodes)
    assert [p.name for p in out.parent.iterdir()] == ["costs.json"]  # no temporary left


def test_calibration_by_hand(tmp_path: Path) -> None:
    """Two blocks: mm0 measured (raw 1.5 ms), mm1 shares its signature, add0 constant-folded,
    add1 below the profiler's own 0.5 ms per event, relu0 and relu1 unmeasured (analytic: the
    device's 1 ms launch overhead, its roofline term is negligible). Weights: mm 1.5 - 0.5 +
    0.25 = 1.25 each, add0 0, add1 0 + 0.25, relu 1 each: 4.75 in all, scaled to 9.5 ms."""
    graph = load(blocks_model(tmp_path, blocks=2), batch_size=4)
    index = {n.key: i for i, n in enumerate(graph.nodes)}
    digest = {"mm0": "mm", "mm1": "mm", "add0": "folded", "add1": "tiny", "relu0": "r0",
              "relu1": "r1"}
    times = SignatureTimes({"mm": 1.5, "folded": FOLDED, "tiny": 0.2}, {index["mm0"]},
                           event_overhead_ms=0.5, node_overhead_ms=0.25, whole_ms=9.5,
                           whole_cached=False)
    spec = DeviceSpec("t", peak_gflops=1e15, mem_gbps=1e15, launch_overhead_ms=1.0)
    got = calibrate(graph, {index[k]: (d, False) for k, d in digest.items()}, times, spec,
                    {"Relu": 3.0})
    weights = {"mm0": 1.25, "mm1": 1.25, "add0": 0.0, "add1": 0.25, "relu0": 1.0, "relu1": 1.0}
    assert got.weights_sum_ms == pytest.approx(4.75) and got.scale == pytest.approx(2.0)
    assert got.forward_ms == pytest.approx({k: 2 * w for k, w in weights.items()})
    assert got.backward_ms == pytest.approx({"mm0": 5.0, "mm1": 5.0, "add0": 0.0, "add1": 0.5,
                                             "relu0": 6.0, "relu1": 6.0})
    assert got.raw_sum_ms == pytest.approx(1.5 + 1.5 + 0.0 + 0.2 + 1.0 + 1.0)
    assert (got.analytic_nodes, got.reused) == (2, 3)  # mm1, add0, add1 not measured here
    nothing = SignatureTimes({"mm": FOLDED}, set(), 0.0, 0.0, 7.0, False)
    free = calibrate(graph, {index["mm0"]: ("mm", False)}, nothing, spec, {})
    assert free.forward_ms == {"mm0": 0.0} and free.scale == 1.0  # nothing to scale


def test_matmul_times_follow_their_sizes(tmp_path: Path, cache: Path) -> None:
    """A chain of three MatMuls of 65 K, 4 M and 134 M multiply-adds (256 rows, each 30x or more
    the one before, so that a noisy machine cannot swap them): measured, their calibrated times
    keep that order, and the largest takes most of the time."""
    nodes, inits, x = [], [], "x"
    for name, (rows, cols) in {"small": (16, 16), "medium": (16, 1024),
                               "large": (1024, 512)}.items():
        inits.append(_init(f"w_{name}", [rows, cols], cols))
        nodes.append(helper.make_node("MatMul", [x, f"w_{name}"], [name], name=name))
        x = name
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 16])]
    result = profile_model(load(_save(tmp_path, nodes, inputs, [x], inits)), cache_dir=cache,
                           repeats=5, warmup=1)
    ms = result.forward_ms
    assert ms["small"] < ms["medium"] < ms["large"] and ms["large"] > 0.5 * sum(ms.values())


def test_every_compute_node_is_costed_and_free_nodes_are_not(tmp_path: Path,
                                                              cache: Path) -> None:
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [-1, 16])
    nodes = [
        helper.make_node("Constant", [], ["shape"], name="const", value=shape),
        helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape"),
        helper.make_node("MatMul", ["y", "w"], ["z"], name="mm"),
        helper.make_node("Tanh", ["z"], ["out"], name=""),  # key: its output's name
    ]
    inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4, 4])
    graph = load(_save(tmp_path, nodes, [inp], ["out"], [_init("w", [16, 8], 0)]))
    result = fast(graph, cache)
    assert set(result.forward_ms) == {"reshape", "mm", "out"} == set(result.backward_ms)
    assert result.backward_ms["mm"] == pytest.approx(2 * result.forward_ms["mm"])
    assert result.backward_ms["out"] == pytest.approx(result.forward_ms["out"])
    assert result.settings["analytic_nodes"] == 0


def test_repeated_blocks_measure_each_signature_once(blocks: OpGraph, cache: Path) -> None:
    result = fast(blocks, cache)
    assert result.unique_signatures == 3  # MatMul, Add, Relu
    assert result.reused == len(blocks.nodes) - 3
    for kind in ("mm", "add", "relu"):
        times = {result.forward_ms[f"{kind}{b}"] for b in range(6)}
        assert len(times) == 1  # shared measurement


def test_second_call_is_served_from_the_cache(blocks: OpGraph, cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    first = fast(blocks, cache)

    def no_session(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached profile must not create sessions")

    monkeypatch.setattr(ort, "InferenceSession", no_session)
    second = fast(blocks, cache)
    assert second.unique_signatures == 0 and second.reused == len(blocks.nodes)
    assert second.settings["whole_cached"] is True
    assert second.forward_ms == pytest.approx(first.forward_ms)


def test_cache_folder_from_environment(blocks: OpGraph, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env-cache"))
    result = profile_model(blocks, repeats=3, warmup=1)
    assert str(result.settings["cache"]).startswith(str(tmp_path / "env-cache"))
    assert any((tmp_path / "env-cache").iterdir())


def test_big_matmul_gets_most_of_the_time(tmp_path: Path, cache: Path) -> None:
    """One large MatMul and 40 tiny Adds: the profile must put the time on the MatMul."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["big"], name="big")]
    prev = "s"
    for i in range(40):
        nodes.append(helper.make_node("Add", [prev, "one"], [f"s{i}"], name=f"tiny{i}"))
        prev = f"s{i}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 256]),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, [4])]
    one = numpy_helper.from_array(np.ones(4, np.float32), "one")
    path = _save(tmp_path, nodes, inputs, ["big", prev], [_init("w", [256, 256], 0), one])
    result = profile_model(load(path), cache_dir=cache, repeats=5, warmup=1)
    total = sum(result.forward_ms.values())
    assert result.forward_ms["big"] > 0.5 * total
    assert result.unique_signatures == 2


def test_backward_follows_analytic_ratios_and_overrides(blocks: OpGraph, cache: Path) -> None:
    result = fast(blocks, cache)
    assert result.backward_ms["mm0"] == pytest.approx(2 * result.forward_ms["mm0"])
    assert result.backward_ms["add0"] == pytest.approx(result.forward_ms["add0"])
    custom = fast(blocks, cache, backward_ratio={"Add": 3.0})
    assert custom.backward_ms["add0"] == pytest.approx(3 * custom.forward_ms["add0"])
    with pytest.raises(PartitionError, match="ratios"):
        fast(blocks, cache, backward_ratio={"Add": -1.0})


def test_progress_reaches_its_total(blocks: OpGraph, cache: Path) -> None:
    calls: list[tuple[int, int]] = []
    fast(blocks, cache, progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1][0] == calls[-1][1]
    assert all(0 <= d <= t for d, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_computed_integer_inputs_are_captured(tmp_path: Path, cache: Path) -> None:
    """Reshape's shape comes from Shape -> Concat at run time: its value must be real."""
    minus1 = numpy_helper.from_array(np.array([-1], np.int64), "minus1")
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"], name="shape", start=0, end=1),
        helper.make_node("Concat", ["sh", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "target"], ["out"], name="reshape"),
    ]
    inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 8])
    graph = load(_save(tmp_path, nodes, [inp], ["out"], [minus1]), batch_size=3)
    result = fast(graph, cache)
    assert set(result.forward_ms) == {"shape", "concat", "relu", "reshape"}
    assert result.settings["captured_values"] == 2  # sh for Concat, target for Reshape


def test_external_data_resolves_from_the_models_folder(tmp_path: Path, cache: Path) -> None:
    path = blocks_model(tmp_path, blocks=2)
    ext = tmp_path / "ext"
    ext.mkdir()
    moved = ext / "m.onnx"
    onnx.save_model(onnx.load(path), moved, save_as_external_data=True,
                    location="m.onnx.data", size_threshold=0)
    before = sorted(p.name for p in ext.iterdir())
    result = fast(load(moved, batch_size=2), cache)
    assert len(result.forward_ms) == 6
    assert sorted(p.name for p in ext.iterdir()) == before  # nothing left beside the model


def test_whole_model_method_covers_every_node(blocks: OpGraph, cache: Path) -> None:
    result = fast(blocks, cache, method="whole")
    assert set(result.forward_ms) == {n.key for n in blocks.nodes}
    assert result.unique_signatures == 3 and result.settings["analytic_nodes"] == 0


def test_profile_to_file(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "costs.json"
    result = profile_to_file(blocks_model(tmp_path), out, batch_size=2, repeats=2,
                             cache_dir=cache)
    costs = read_costs(out)
    assert {k: v["forward_ms"] for k, v in costs.items()} == pytest.approx(result.forward_ms,
                                                                          abs=1e-6)
    assert result.settings["repeats"] == 2 and costs.keys() == {n.key for n in load(
        blocks_model(tmp_path), batch_size=2).nodes}
    with pytest.raises(PartitionError, match="symbolic"):
        profile_to_file(blocks_model(tmp_path), out, repeats=2, cache_dir=cache)
    with pytest.raises(PartitionError, match="no such file"):
        profile_to_file(tmp_path / "missing.onnx", out, batch_size=2, cache_dir=cache)
    with pytest.raises(PartitionError, match="folder"):
        profile_to_file(blocks_model(tmp_path), tmp_path, batch_size=2, cache_dir=cache)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0", "", "cuda:-1"])
def test_bad_device_string(device: str, blocks: OpGraph, tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match="unknown device"):
        profile_model(blocks, device=device, cache_dir=tmp_path)
    with pytest.raises(PartitionError, match="unknown device"):  # before loading the model
        profile_to_file(tmp_path / "missing.onnx", tmp_path / "c.json", device=device)


def test_bad_repeats(blocks: OpGraph, tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match="repeats"):
        profile_model(blocks, repeats=0, cache_dir=tmp_path)


@pytest.mark.skipif(HAS_CUDA, reason="onnxruntime has CUDA here")
def test_cuda_without_onnxruntime_gpu_is_a_clear_error(blocks: OpGraph, tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match="onnxruntime-gpu"):
        profile_model(blocks, device="cuda:0", cache_dir=tmp_path)


@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and a CUDA device")
def test_cuda_profile(blocks: OpGraph, cache: Path) -> None:
    assert parse_device("cuda") == ("cuda:0", 0)
    result = fast(blocks, cache, device="cuda:0")
    assert result.device == "cuda:0" and set(result.forward_ms) == {n.key for n in blocks.nodes}
    assert result.unique_signatures == 3


def test_event_names_map_back_to_keys() -> None:
    names = {"node_mm": "node_mm", "add_1": "add_1", "relu#p0": "node_relu"}
    assert _match_key("node_mm", names) == "node_mm"
    assert _match_key("node_mm/MatMulScaleFusion/", names) == "node_mm"
    assert _match_key("relu#p0_nchwc", names) == "node_relu"
    assert _match_key("add_1_fused", names) == "add_1"
    assert _match_key("ReorderInput_token_3", names) is None
