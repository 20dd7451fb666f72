"""onnxruntime sessions: options, and the providers of a plan's device names."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import onnxruntime as ort

from onnx_partition.errors import PartitionError
from onnx_partition.values import device_index

__all__ = ["HasProviders", "Provider", "check_providers", "local_device", "no_cuda_message",
           "open_session", "provider_name", "providers_for", "session_options"]

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


class HasProviders(Protocol):
    """What :func:`check_providers` reads of a session (an ``ort.InferenceSession``)."""

    def get_providers(self) -> list[str]: ...

    def get_provider_options(self) -> dict[str, dict[str, Any]]: ...


def provider_name(provider: Provider) -> str:
    """``"CUDAExecutionProvider"`` of ``("CUDAExecutionProvider", {...})`` or of the name."""
    return provider if isinstance(provider, str) else provider[0]


def check_providers(session: HasProviders, asked: Sequence[Provider], what: str) -> None:
    """A one-line PartitionError unless ``session`` runs on the provider asked for first (and
    on its ``device_id``): onnxruntime falls back to the next provider, usually CPU, with only
    a warning when a provider's libraries do not load (CUDA without cuDNN, a wrong CUDA
    version), which would run a GPU plan on CPU unnoticed. ``what`` names the model."""
    if not asked:
        return
    wanted = provider_name(asked[0])
    got = list(session.get_providers())
    if not got or got[0] != wanted:
        raise PartitionError(
            f"{what}: onnxruntime gave {got[0] if got else 'no provider'} instead of {wanted} "
            f"(its libraries did not load here: check onnxruntime.get_available_providers() "
            f"and the CUDA/cuDNN versions this onnxruntime needs)")
    if isinstance(asked[0], tuple) and "device_id" in asked[0][1]:
        options = session.get_provider_options().get(wanted, {})
        had = options.get("device_id")
        if had is not None and str(had) != str(asked[0][1]["device_id"]):
            raise PartitionError(f"{what}: onnxruntime put it on {wanted} device {had} instead "
                                 f"of device {asked[0][1]['device_id']}")


def open_session(model: str | bytes, options: ort.SessionOptions, providers: Sequence[Provider],
                 what: str) -> ort.InferenceSession:
    """An onnxruntime session of ``model`` (a path or the serialized model) on ``providers``,
    checked by :func:`check_providers`. onnxruntime's own load errors propagate (callers name
    the stage); its fallback warning is silenced since the check replaces it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Specified provider", category=UserWarning)
        session = ort.InferenceSession(model, sess_options=options, providers=list(providers))
    check_providers(session, providers, what)
    return session
