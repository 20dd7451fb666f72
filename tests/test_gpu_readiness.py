"""What the first GPU run relies on, checked on CPU: the provider a session got, torchrun
placement against the plan, the inference wire's copies and headers per hop, and the CUDA
profiler's buffer rotation and signature batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from support.graphs import CHAIN, SKIP, save
from support.outputs import assert_same, run_whole
from support.wire import CapturedWire

from onnx_partition.cost.profile.cuda import own_inputs, rotation_sets
from onnx_partition.cost.profile.harness import Context
from onnx_partition.cost.profile.sigmodel import flow_values, signature_model
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.graph.ort import check_providers, open_session, session_options
from onnx_partition.partition import partition
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.plan import read_plan
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.infer.processes import run_distributed
from onnx_partition.runtime.infer.worker import check_hop, choose_backend, hop_key
from onnx_partition.runtime.launch.ranks import TorchrunEnv, check_placement, torchrun_env
from onnx_partition.runtime.wire import header_size

CUDA0 = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]


class FakeSession:
    """What onnxruntime hands back when CUDA's libraries do not load: a CPU session."""

    def __init__(self, providers: list[str], options: dict[str, dict[str, Any]]) -> None:
        self.providers, self.options = providers, options

    def get_providers(self) -> list[str]:
        return self.providers

    def get_provider_options(self) -> dict[str, dict[str, Any]]:
        return self.options


def _relu() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph).SerializeToString()


# --------------------------------------------------------------------------- providers


def test_a_silent_fallback_to_cpu_is_refused_naming_what_it_got():
    fallen = FakeSession(["CPUExecutionProvider"], {"CPUExecutionProvider": {}})
    with pytest.raises(PartitionError) as info:
        check_providers(fallen, CUDA0, "s1.onnx on cuda:0")
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("s1.onnx on cuda:0: onnxruntime gave CPUExecutionProvider instead "
                           "of CUDAExecutionProvider")


def test_the_provider_asked_for_passes_and_a_wrong_gpu_does_not():
    on_gpu = FakeSession(["CUDAExecutionProvider", "CPUExecutionProvider"],
                         {"CUDAExecutionProvider": {"device_id": "0"}})
    check_providers(on_gpu, CUDA0, "s")
    check_providers(on_gpu, ["CUDAExecutionProvider"], "s")
    with pytest.raises(PartitionError, match="device 0 instead of device 1"):
        check_providers(on_gpu, [("CUDAExecutionProvider", {"device_id": 1})], "s")
    check_providers(FakeSession(["CPUExecutionProvider"], {}), ["CPUExecutionProvider"], "s")


def test_a_real_onnxruntime_fallback_is_refused():
    """This onnxruntime has no TensorRT: it falls back to CPU with a warning; we refuse."""
    with pytest.raises(PartitionError, match="gave CPUExecutionProvider instead of "
                                             "TensorrtExecutionProvider"):
        open_session(_relu(), session_options(1),
                     ["TensorrtExecutionProvider", "CPUExecutionProvider"], "relu")
    session = open_session(_relu(), session_options(1), ["CPUExecutionProvider"], "relu")
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_a_pipeline_on_a_missing_provider_is_a_one_line_error(tmp_path):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "out", batch_size=2)
    with pytest.raises(PartitionError) as info:
        PipelineSession(tmp_path / "out",
                        providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert "\n" not in str(info.value)
    assert "instead of TensorrtExecutionProvider" in str(info.value)


# --------------------------------------------------------------------------- placement


def _env(rank: int, world: int, local_world: int, group: int) -> TorchrunEnv:
    return torchrun_env({"RANK": str(rank), "WORLD_SIZE": str(world),
                         "LOCAL_RANK": str(rank % local_world),
                         "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(group),
                         "MASTER_ADDR": "h", "MASTER_PORT": "29500"})


def _name(rank: int) -> str:
    return f"rank {rank}"


TWO_MACHINES = ["m0/cuda:0", "m0/cuda:1", "m1/cuda:0", "m1/cuda:1"]


def test_placement_matching_torchrun_is_accepted():
    for rank in range(4):
        check_placement(_env(rank, 4, 2, rank // 2), TWO_MACHINES, _name, device_count=2)
    # one machine, no prefixes; CPU plans skip the GPU part (no GPU here)
    check_placement(_env(1, 2, 2, 0), ["cuda:0", "cuda:1"], _name, device_count=2)
    check_placement(_env(3, 4, 2, 1), ["m0/cpu", "m0/cpu", "m1/cpu", "m1/cpu"], _name,
                    device_count=0)
    assert _env(0, 2, 2, 0).group_rank == 0
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h",
                         "MASTER_PORT": "1"}).group_rank == 0


def test_a_plan_in_another_rank_order_is_refused_naming_rank_machine_and_gpu():
    # the plan interleaves machines; torchrun numbers ranks machine by machine
    interleaved = ["m0/cuda:0", "m1/cuda:0", "m0/cuda:1", "m1/cuda:1"]
    with pytest.raises(PartitionError) as info:
        check_placement(_env(1, 4, 2, 0), interleaved, _name, device_count=2)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("rank 1 belongs on machine m1 (m1/cuda:0) but torchrun started it "
                           "on machine 0 (GROUP_RANK=0, LOCAL_RANK=1")


def test_a_gpu_this_machine_lacks_is_refused():
    with pytest.raises(PartitionError, match=r"rank 1 expects GPU cuda:1 on machine m0 "
                                             r"\(m0/cuda:1\) but this machine has 1 visible"):
        check_placement(_env(1, 4, 2, 0), TWO_MACHINES, _name, device_count=1)
    with pytest.raises(PartitionError, match="places 4 ranks; torchrun started 2"):
        check_placement(_env(1, 2, 2, 0), TWO_MACHINES, _name, device_count=2)


def test_group_rank_must_be_a_machine_number():
    with pytest.raises(PartitionError, match="GROUP_RANK=-1"):
        torchrun_env({"RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "-1", "MASTER_ADDR": "h",
                      "MASTER_PORT": "1"})



# --------------------------------------------------------------------------- the wire per hop


def _rows(n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)


def _two_stages(tmp_path: Path) -> tuple[Path, Path]:
    model = save(CHAIN, tmp_path / "m.onnx")
    partition(model, 2, tmp_path / "out", batch_size=2)
    return model, tmp_path / "out"


def test_each_hop_sends_its_header_once_and_copies_only_what_it_packs(tmp_path):
    """CHAIN on two gloo ranks, 4 micro-batches of 2 rows, 2 iterations: one header per hop in
    all (every micro-batch has the same rows, no data-dependent size); the only host copies are
    the small tensors packed into one message (one per tensor per micro-batch), none to or from
    a device."""
    model, out = _two_stages(tmp_path)
    plan = read_plan(out)
    assert plan.extra["unknown_size_tensors"] == 0
    feeds = {"x": _rows(8)}
    outputs, stats = run_distributed(out, feeds, nproc=2, microbatches=4, iterations=2,
                                     timeout_s=60)
    assert_same(dict(zip([o.name for o in plan.outputs], outputs)), run_whole(model, feeds))
    lay = layout(plan)
    assert stats.backend == "gloo"
    assert stats.headers == {0: 1, 1: 1}
    assert stats.copies == {0: {"pack": 4 * 2 * len(lay.send_names[0])},
                            1: {"pack": 4 * 2 * len(lay.send_names[1])}}


def test_uneven_and_data_dependent_micro_batches_send_a_header_per_shape(tmp_path):
    model, out = _two_stages(tmp_path)
    feeds = {"x": _rows(7)}  # rows 2, 2, 2, 1: two shapes per hop
    outputs, stats = run_distributed(out, feeds, nproc=2, microbatches=4, iterations=2,
                                     timeout_s=60)
    assert stats.headers == {0: 2, 1: 2}
    plan_file = out / "plan.json"  # a plan that may hold data-dependent sizes: per micro-batch
    plan = json.loads(plan_file.read_text())
    del plan["unknown_size_tensors"]
    plan_file.write_text(json.dumps(plan))
    again, stats = run_distributed(out, feeds, nproc=2, microbatches=4, iterations=2,
                                   timeout_s=60)
    assert stats.headers == {0: 4, 1: 4}  # the first iteration's only
    for a, b in zip(outputs, again):
        np.testing.assert_array_equal(a, b)
    assert_same(dict(zip([o.name for o in read_plan(out).outputs], again)),
                run_whole(model, feeds))


def test_hop_keys_follow_the_plans_sizes(tmp_path):
    _, out = _two_stages(tmp_path)
    plan = read_plan(out)
    assert hop_key(plan, 3, 2) == ("rows", 2)
    plan.extra["unknown_size_tensors"] = 1
    assert hop_key(plan, 3, 2) == ("microbatch", 3)


def test_inference_defaults_to_gloo_until_nccl_is_confirmed():
    lay = Layout([1, 1], [0, 1], [["cuda:0"], ["cuda:1"]], [["x"], ["a"]], [["a"], ["y"]])
    assert choose_backend(lay, None, auto_nccl=False) == "gloo"
    assert choose_backend(lay, "nccl", auto_nccl=False) == "nccl"


# --------------------------------------------------------------------------- CUDA profiling


def test_rotation_outgrows_l2_within_the_budget():
    """R sets such that the R - 1 sets read between two reads of one exceed twice the L2."""
    l2 = 50 << 20
    assert rotation_sets(50 << 20, l2, 1 << 40) == 3  # 2 other sets of 50 MB >= 2 x L2
    assert rotation_sets(40 << 20, l2, 1 << 40) == 4  # ceil(100 / 40) + 1
    assert rotation_sets(1 << 30, l2, 1 << 40) == 2  # larger than L2: alternate two
    assert rotation_sets(1 << 10, l2, 1 << 40) == 64  # tiny inputs: capped
    assert rotation_sets(40 << 20, l2, 100 << 20) == 2  # two sets fit the budget
    assert rotation_sets(40 << 20, l2, 100 << 20, set_bytes=80 << 20) == 1
    assert rotation_sets(0, l2, 1 << 40) == 1


def test_each_copy_reads_its_own_inputs_and_computes_the_same(tmp_path):
    """On CPU: copy c of a node reads ``name#in<c>``, a distinct buffer of equal values, and
    the model runs (the CUDA timing's signature models are these)."""
    graph = load(save(CHAIN, tmp_path / "m.onnx"), batch_size=2)
    ctx = Context(graph, "cpu", None, 1, 0, 1)
    rep = next(i for i, n in enumerate(graph.nodes) if n.op_type == "Add")
    key = graph.nodes[rep].key
    model, feeds = own_inputs(*signature_model(ctx, [rep], 3, flow_values(ctx, [rep])), [key])
    inputs = {n.name: list(n.input) for n in model.graph.node}
    flow = [n for n in graph.nodes[rep].inputs if n in feeds]
    assert flow and inputs[f"{key}#copy2"] == [
        f"{n}#in2" if n in flow else n for n in graph.nodes[rep].inputs]
    assert inputs[key] == list(graph.nodes[rep].inputs)
    assert [i.name for i in model.graph.input] == [*flow, *(f"{n}#in{c}" for c in (1, 2)
                                                          for n in flow)]
    for n in flow:
        assert not np.shares_memory(feeds[n], feeds[f"{n}#in1"])
        np.testing.assert_array_equal(feeds[f"{n}#in2"], feeds[n])
    session = open_session(model.SerializeToString(), session_options(1),
                           ["CPUExecutionProvider"], "copies")
    session.run(None, feeds)


# --------------------------------------------------------------------------- the device hop


def test_the_device_hop_runs_through_iobinding_without_host_copies(tmp_path):
    """hop="device" on CPU and gloo: the same IOBinding and DLPack path a GPU takes, outputs
    equal to the whole model and the host hop, no copy anywhere, one header per hop."""
    model, out = _two_stages(tmp_path)
    feeds = {"x": _rows(8)}
    host, _ = run_distributed(out, feeds, nproc=2, microbatches=4, iterations=2, timeout_s=60)
    device, stats = run_distributed(out, feeds, nproc=2, microbatches=4, iterations=2,
                                    timeout_s=60, hop="device")
    for a, b in zip(host, device):
        np.testing.assert_array_equal(a, b)
    assert_same(dict(zip([o.name for o in read_plan(out).outputs], device)),
                run_whole(model, feeds))
    assert stats.copies == {0: {}, 1: {}}
    assert stats.headers == {0: 1, 1: 1}


def test_the_device_hop_relays_skips_over_three_stages(tmp_path):
    model = save(SKIP, tmp_path / "m.onnx")
    partition(model, 3, tmp_path / "out", batch_size=2)
    feeds = {"x": _rows(6), "z": _rows(6)}
    outputs, stats = run_distributed(tmp_path / "out", feeds, nproc=3, microbatches=3,
                                     timeout_s=60, hop="device")
    assert_same(dict(zip([o.name for o in read_plan(tmp_path / "out").outputs], outputs)),
                run_whole(model, feeds))
    assert all(not c for c in stats.copies.values())


def test_the_device_hop_of_a_cuda_plan_needs_nccl():
    cuda = Layout([1, 1], [0, 1], [["cuda:0"], ["cuda:1"]], [["x"], ["a"]], [["a"], ["y"]])
    with pytest.raises(PartitionError, match="needs backend nccl"):
        check_hop(cuda, "gloo", "device")
    check_hop(cuda, "nccl", "device")
    check_hop(cuda, "gloo", "host")
    with pytest.raises(PartitionError, match="unknown hop 'gpu'"):
        check_hop(cuda, "gloo", "gpu")



def test_a_keyed_hop_sends_its_header_once_and_refuses_a_changed_shape():
    wire = CapturedWire()
    a = {"a": np.ones((2, 4), np.float32)}
    wire.send(1, 0, ["a"], a, [], key=("rows", 2))
    wire.send(1, 1, ["a"], a, [], key=("rows", 2))
    wire.send(2, 1, ["a"], a, [], key=("rows", 2))  # another peer: its own header
    assert [len(m) for m in wire.sent] == [header_size(1), 32, 32, header_size(1), 32]
    assert wire.headers_sent == 2 and wire.copies == {"pack": 3}
    with pytest.raises(RuntimeError, match=r"tensor 'a' of micro-batch 2 has shape \(3, 4\), "
                                           r"not the \(2, 4\) sent once"):
        wire.send(1, 2, ["a"], {"a": np.ones((3, 4), np.float32)}, [], key=("rows", 2))
    readonly = np.ones((2, 4), np.float32)
    readonly.flags.writeable = False
    wire.send(1, 3, ["a"], {"a": readonly}, [])  # no key: a header every time
    assert wire.headers_sent == 3 and wire.copies["readonly"] == 1
