"""onnxruntime sessions: options, and the providers of a plan's device names."""

from __future__ import annotations

import re
from typing import Any

import onnxruntime as ort

from onnx_partition.errors import PartitionError
from onnx_partition.values import device_index

__all__ = ["Provider", "local_device", "no_cuda_message", "providers_for", "session_options"]

Provider = str | tuple[str, dict[str, Any]]

_MACHINE = re.compile(r"m\d+/")


def local_device(device: str) -> str:
    """The device on the machine that runs it: ``m1/cuda:3`` -> ``cuda:3`` (plans for several
    machines prefix each device with its machine; a machine runs only its own ranks)."""
    return _MACHINE.sub("", device, count=1) if _MACHINE.match(device) else device


def providers_for(device: str) -> list[Provider]:
    """onnxruntime providers for a plan device name: ``cpu`` or ``cuda:N``, optionally on a
    machine ``mK/`` (see :func:`local_device`)."""
    device = local_device(device)
    index = device_index(device)
    if index is None:
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise PartitionError(no_cuda_message(device))
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def no_cuda_message(device: str) -> str:
    return (f"the plan puts stages on {device} but onnxruntime here has no CUDA (install "
            "onnx-partition[gpu] on a GPU machine); to check its numerics on CPU: "
            "onnx-partition run PLAN --device cpu, or PipelineSession(PLAN, "
            "providers=['CPUExecutionProvider'])")


def session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    return options
