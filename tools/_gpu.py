"""What the GPU check scripts share: the device model of the GPU they run on, the numerics
tolerance of a math mode, onnxruntime CUDA providers, and tables docs/benchmarks.md takes as is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnx_partition.cost.devices import GPUS

#: Largest relative error (max |a - e| / max |e|) that rounding explains, by math mode: IEEE
#: fp32 with a different kernel or fusion at stage boundaries stays near 1e-5, so 1e-3 has
#: margin; TF32 rounds products to a 10-bit mantissa (2^-11 = 4.9e-4 each), compounded over
#: the layers, so 2e-2.
TOLERANCE = {"fp32": 1e-3, "tf32": 2e-2}


def gpu_key(device_name: str, memory_bytes: int) -> str | None:
    """The :data:`~onnx_partition.cost.devices.GPUS` key of a CUDA device, from its name and
    memory (``torch.cuda.get_device_properties``), or None for a GPU the model lacks."""
    name = device_name.lower()
    for key in ("h200", "h100", "v100", "l4"):
        if key in name:
            return key
    if "a100" in name:
        return "a100-80gb" if memory_bytes > 48 << 30 else "a100-40gb"
    return None


def here_gpu(index: int = 0) -> tuple[str, str]:
    """(device name, device model key) of CUDA device ``index``; the key is ``h100`` (the
    default, named in the table) when the device model has no such GPU."""
    import torch

    props = torch.cuda.get_device_properties(index)
    key = gpu_key(props.name, props.total_memory)
    assert key is None or key in GPUS
    return props.name, key or "h100"


def cuda_providers(index: int, tf32: bool) -> list[Any]:
    """onnxruntime's CUDA provider on ``index`` with TF32 on or off (``use_tf32``), then CPU."""
    return [("CUDAExecutionProvider", {"device_id": index, "use_tf32": int(tf32)}),
            "CPUExecutionProvider"]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (docs/benchmarks.md's form)."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
