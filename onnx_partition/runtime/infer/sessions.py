"""Load a plan folder's stage files into onnxruntime sessions, after checking the folder."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.graph.ort import Provider, open_session, providers_for, session_options
from onnx_partition.plan import IOSpec, Plan, read_plan
from onnx_partition.plan.folder import verify

__all__ = ["NodeArg", "StageSession", "check_devices", "load_stages", "node_args", "onnx_type",
           "verify_plan_folder"]

def verify_plan_folder(
    folder: Path, plan: Plan, *, stages: Sequence[int] | None = None
) -> list[Path]:
    """Every file of the plan folder (or of ``stages`` only) matches plan.json's manifest, size
    and sha256 (:func:`onnx_partition.plan.folder.verify`); returns the stage files' paths.

    Runs before any session is created, so a bad folder fails fast and clearly.
    """
    return verify(folder, plan, stages=stages)


def check_devices(plan: Plan, providers: Sequence[Provider] | None = None) -> None:
    """Fail at once, before any session or process starts, when the plan needs CUDA and
    onnxruntime here has none (``providers`` given: they replace the plan's devices)."""
    if providers is not None:
        return
    for stage in plan.stages:
        for device in stage.devices:
            providers_for(device)  # raises with :func:`no_cuda_message`


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime's ``NodeArg``: ``name``, ``shape`` (ints, and
    strings for symbolic dims), ``type`` (``"tensor(float)"``)."""

    name: str
    shape: list[int | str]
    type: str


def onnx_type(dtype: str) -> str:
    """A numpy dtype name as onnxruntime spells the tensor type: float32 -> tensor(float)."""
    if dtype == "unknown":
        return "tensor(float)"
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return f"tensor({TensorProto.DataType.Name(elem).lower()})"


def node_args(specs: Sequence[IOSpec]) -> list[NodeArg]:
    return [NodeArg(s.name, list(s.shape), onnx_type(s.dtype)) for s in specs]


@dataclass
class StageSession:
    """One stage replica: its onnxruntime session and the names it reads and writes."""

    index: int
    replica: int
    device: str
    session: ort.InferenceSession
    inputs: list[str]
    outputs: list[str]


def load_stages(
    folder: str | os.PathLike[str],
    *,
    providers: Sequence[Provider] | None = None,
    threads_per_stage: int = 1,
    verify: bool = True,
) -> tuple[Plan, list[list[StageSession]]]:
    """The plan and, per stage, one session per replica on that replica's device.

    ``providers`` overrides the plan's devices for every stage (like onnxruntime's argument).
    """
    folder = Path(folder)
    plan = read_plan(folder)
    check_devices(plan, providers)
    paths = verify_plan_folder(folder, plan) if verify else [folder / s.file for s in plan.stages]
    stages = []
    for stage, path in zip(plan.stages, paths):
        devices = stage.devices or ["cpu"]
        replicas = []
        for replica in range(max(1, stage.replicas)):
            device = devices[replica % len(devices)]
            chosen = list(providers) if providers is not None else providers_for(device)
            try:
                session = open_session(str(path), session_options(threads_per_stage), chosen,
                                       f"{stage.file} on {device}")
            except PartitionError:  # the provider it got is not the one asked for
                raise
            except Exception as exc:  # onnxruntime raises its own exception types
                first = one_line(exc)
                raise PartitionError(f"cannot load {stage.file} on {device}: {first}") from None
            replicas.append(StageSession(stage.index, replica, device, session,
                                         list(stage.inputs), list(stage.outputs)))
        stages.append(replicas)
    return plan, stages
