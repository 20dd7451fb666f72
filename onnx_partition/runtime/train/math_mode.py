"""The matrix-product math a train run computes in, set to what its plan was priced in.

A train plan records its ``math`` (plan.json): ``fp32`` (IEEE float32 products), ``tf32``
(float32 tensors, products on TF32 tensor cores: 10-bit mantissas, the A100/H100 peak the
analytic model prices fp32 graphs at), ``bf16`` or ``fp16`` (autocast). torch's own defaults
are neither: matrix products in fp32 (``torch.backends.cuda.matmul.allow_tf32`` off since 1.12)
and convolutions in TF32 (``torch.backends.cudnn.allow_tf32`` on). The engine sets both flags
on every run, so a plan priced at TF32 runs at TF32 and one priced at fp32 runs at fp32;
``--check`` compares at the tolerance of that math
(:func:`onnx_partition.runtime.train.reference.check_tolerance`). What a plan is priced in:
:func:`onnx_partition.cost.devices.math_of`.
"""

from __future__ import annotations

import torch

__all__ = ["apply_math", "flags_math", "run_math"]


def run_math(plan_math: str | None, precision: str) -> str:
    """The math a run computes in: the run's autocast precision when half (``train
    --precision`` may differ from the plan's), else the plan's fp32 or tf32."""
    if precision in ("bf16", "fp16"):
        return precision
    return plan_math if plan_math in ("fp32", "tf32") else "fp32"


def apply_math(math: str) -> None:
    """torch's TF32 flags set to ``math`` (TF32 on for ``tf32`` only; under bf16 and fp16
    autocast the products that stay float32 run in IEEE fp32)."""
    tf32 = math == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def flags_math(precision: str) -> str:
    """The math torch's flags compute float32 products in now (``tf32`` when both TF32 flags
    are on), or the autocast ``precision`` when half: what a rank reports it ran in."""
    if precision in ("bf16", "fp16"):
        return precision
    tf32 = torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    return "tf32" if tf32 else "fp32"
