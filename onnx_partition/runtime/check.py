"""Feeds for a plan and the whole model's reference outputs, to check a pipelined run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan
from onnx_partition.runtime import microbatch
from onnx_partition.runtime.stages import session_options


def random_feeds(
    plan: Plan, *, batch_size: int | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs of the plan's dtypes and shapes (integer inputs kept in their valid range).

    Symbolic dims take the sizes used at partition time; ``batch_size`` overrides dim 0.
    """
    rng = np.random.default_rng(seed)
    fixed = plan.extra.get("input_shapes", {})
    feeds = {}
    for spec in plan.inputs:
        shape = list(fixed.get(spec.name, spec.shape))
        if batch_size is not None and shape:
            shape[0] = batch_size
        if any(not isinstance(d, int) for d in shape):
            raise PartitionError(f"input {spec.name!r} has symbolic dims {shape}; give its shape")
        dtype = np.dtype(spec.dtype) if spec.dtype != "unknown" else np.dtype("float32")
        if dtype == np.bool_:
            feeds[spec.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            high = spec.high if spec.high else 2
            feeds[spec.name] = rng.integers(0, high, size=shape).astype(dtype)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def whole_model_outputs(
    plan_dir: str | Path, plan: Plan, feeds: Mapping[str, np.ndarray], *, threads: int = 1
) -> dict[str, np.ndarray]:
    """Outputs of the original model (``plan.model``, relative to the plan folder)."""
    model = (Path(plan_dir) / plan.model).resolve()
    if not model.is_file():
        raise PartitionError(f"the plan's model {model} is missing; cannot check outputs")
    session = ort.InferenceSession(str(model), sess_options=session_options(threads),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in plan.outputs]
    # A model whose inputs all fix their leading dim takes that many rows a call: a run of
    # several micro-batches is checked one micro-batch at a time.
    fixed = {s.shape[0] for s in plan.inputs if s.shape}
    rows = microbatch.batch_size(feeds)
    parts = [dict(feeds)]
    if len(fixed) == 1 and all(isinstance(d, int) and d > 0 for d in fixed):
        size = int(fixed.pop())
        if rows != size and rows % size == 0:
            parts = microbatch.split(dict(feeds), rows // size)
    try:
        outputs = [dict(zip(names, session.run(names, part))) for part in parts]
    except Exception as exc:  # onnxruntime raises its own types
        text = (str(exc).strip().splitlines() or ["?"])[0]
        raise PartitionError(f"the whole model cannot run these inputs: {text}") from None
    return microbatch.merge(outputs)


def compare(actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> float:
    """Largest relative error over all outputs: max |a - e| / max |e| per output."""
    worst = 0.0
    for name, want in expected.items():
        got = np.asarray(actual[name])
        if got.shape != want.shape:
            return float("inf")
        if want.size == 0:
            continue
        if not np.issubdtype(want.dtype, np.floating):
            worst = max(worst, float(np.any(got != want)))
            continue
        scale = float(np.max(np.abs(want))) or 1.0
        worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - want))) / scale)
    return worst
