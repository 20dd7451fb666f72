"""What the first GPU run relies on, checked on CPU: the provider a session got, torchrun
placement against the plan, the inference wire's copies and headers per hop, and the CUDA
profiler's buffer rotation and signature batches."""

from __future__ import annotations

from typing import Any

import pytest
from onnx import TensorProto, helper
from support.graphs import CHAIN, save

from onnx_partition.errors import PartitionError
from onnx_partition.graph.ort import check_providers, open_session, session_options
from onnx_partition.partition import partition
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.dist.launcher import TorchrunEnv, check_placement, torchrun_env

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

