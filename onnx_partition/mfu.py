"""A training step's throughput in tokens and its model FLOPs utilisation (MFU).

MFU as PaLM defines it (Chowdhery et al. 2022, appendix B): a model of ``P`` parameters does
about ``6 P`` FLOPs per token in training (2 forward, 4 backward; attention's own FLOPs and any
recomputation left out), so a step of ``T`` tokens in ``t`` seconds on ``G`` GPUs of dense
peak ``F`` FLOP/s uses ``6 P T / (t G F)`` of what they could do. :func:`train_rates` is that
arithmetic, one place (``partition``'s summary and ``tools/bench_llama3.py`` call it);
:func:`model_parameters` counts ``P`` from an ONNX file without its weights' data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TrainRates", "model_parameters", "train_rates"]


@dataclass(frozen=True)
class TrainRates:
    """Tokens per second of the whole step, per GPU, and MFU (None: no peak known)."""

    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float | None


def train_rates(parameters: int, tokens: int, step_ms: float, gpus: int,
                peak_flops: float | None) -> TrainRates:
    """``tokens`` per step of ``step_ms`` on ``gpus`` GPUs: tokens/s, tokens/s per GPU, and
    ``6 x parameters x tokens / (step x gpus x peak_flops)`` (``peak_flops`` per GPU, FLOP/s;
    None or 0: no MFU)."""
    if not (step_ms > 0 and math.isfinite(step_ms)) or gpus < 1:
        raise ValueError(f"need a positive step and at least one GPU, got {step_ms} ms on "
                         f"{gpus}")
    rate = tokens / (step_ms / 1000.0)
    mfu = 6.0 * parameters * rate / (gpus * peak_flops) if peak_flops else None
    return TrainRates(rate, rate / gpus, mfu)


#: ONNX's floating-point element types: the initializers that are parameters (integer ones are
#: shapes and indices)
_FLOATS = ("FLOAT", "FLOAT16", "DOUBLE", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
           "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT4E2M1")


def model_parameters(path: str | Path) -> int:
    """Elements of the floating-point initializers of the ONNX model at ``path``, read without
    external data (a weightless model keeps every initializer's shape)."""
    import onnx

    floats = {getattr(onnx.TensorProto, name) for name in _FLOATS
              if hasattr(onnx.TensorProto, name)}
    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(math.prod(t.dims) for t in graph.initializer if t.data_type in floats)
