"""Feeds for a plan and the whole model's reference outputs, to check a pipelined run.

:func:`random_feeds` is the one rule for a plan's random inputs (``run``, a torchrun rank 0,
the tools and tests); :func:`run_feeds` adds ``run``'s ``--input NAME=FILE.npy`` overrides."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.graph import node_keys
from onnx_partition.graph.ort import session_options
from onnx_partition.pipeline import microbatch
from onnx_partition.pipeline.microbatch import batch_axes
from onnx_partition.plan import Plan

__all__ = ["compare", "random_feeds", "run_feeds", "whole_model_outputs"]


def random_feeds(
    plan: Plan, *, batch_size: int | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs of the plan's dtypes and shapes (integer inputs kept in their valid range).

    Symbolic dims take the sizes used at partition time; ``batch_size`` overrides dim 0.
    """
    rng = np.random.default_rng(seed)
    fixed = plan.input_shapes
    axes = batch_axes(plan)
    feeds = {}
    for spec in plan.inputs:
        shape: list[Any] = list(fixed.get(spec.name, spec.shape))
        axis = axes.get(spec.name, 0)
        if batch_size is not None and axis is not None and len(shape) > axis:
            shape[axis] = batch_size
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


def run_feeds(plan: Plan, inputs: Sequence[str], *, rows: int, seed: int) -> dict[str, np.ndarray]:
    """The feeds of ``run`` (and of a torchrun rank 0): seeded random inputs of ``rows`` rows,
    each ``NAME=FILE.npy`` of ``inputs`` (``--input``) read from its file instead."""
    feeds = random_feeds(plan, batch_size=rows, seed=seed)
    for item in inputs:
        name, sep, file = item.partition("=")
        if not sep or name not in feeds:
            raise PartitionError(f"--input {item!r}: expected NAME=FILE.npy with NAME one of "
                                 f"{', '.join(feeds)}")
        try:
            feeds[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise PartitionError(f"--input {item!r}: cannot read {file}: {exc}") from None
    return feeds


def whole_model_outputs(
    plan_dir: str | Path, plan: Plan, feeds: Mapping[str, np.ndarray], *, threads: int = 1,
    microbatches: int = 1,
) -> dict[str, np.ndarray]:
    """Outputs of the original model (``plan.model``, relative to the plan folder). A model
    with an output that has no batch axis (a loss a model computes itself over its batch)
    runs as the pipeline ran: on each of ``microbatches`` micro-batches, merged as the pipeline
    merges (such an output from the first), so the check compares like with like."""
    model = (Path(plan_dir) / plan.model).resolve()
    if not model.is_file():
        raise PartitionError(f"the plan's model {model} is missing; cannot check outputs")
    session = _whole_session(model, session_options(threads))
    names = [o.name for o in plan.outputs]
    # A model whose inputs all fix their leading dim takes that many rows a call: a run of
    # several micro-batches is checked one micro-batch at a time.
    axes = batch_axes(plan)
    fixed = {s.shape[0] for s in plan.inputs if s.shape}
    rows = microbatch.batch_size(feeds, axes)
    parts = [dict(feeds)]
    unbatched = any(axes.get(o.name, 0) is None for o in plan.outputs)
    if unbatched and microbatches > 1:
        parts = microbatch.split(dict(feeds), microbatches, axes)
    elif len(fixed) == 1 and all(isinstance(d, int) and d > 0 for d in fixed):
        size = int(fixed.pop())
        if rows != size and rows % size == 0:
            parts = microbatch.split(dict(feeds), rows // size, axes)
    try:
        outputs = [dict(zip(names, session.run(names, part))) for part in parts]
    except Exception as exc:  # onnxruntime raises its own types
        text = one_line(exc)
        raise PartitionError(f"the whole model cannot run these inputs: {text}") from None
    return microbatch.merge(outputs, axes)


def _whole_session(model: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    """onnxruntime session of the original model; a model that onnxruntime refuses for
    duplicate node names (the ONNX checker allows them) runs with its nodes named by key."""
    try:
        return ort.InferenceSession(str(model), sess_options=options,
                                    providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types
        first = one_line(exc)
    proto = onnx.load(str(model), load_external_data=False)
    names = [n.name for n in proto.graph.node]
    if len(set(names)) == len(names):
        raise PartitionError(f"cannot run the whole model {model} to check: {first}")
    for node, key in zip(proto.graph.node, node_keys(proto.graph.node)):
        node.name = key
    renamed = model.parent / f".{model.stem}.check-{os.getpid()}.onnx"  # beside its weights
    try:
        onnx.save(proto, str(renamed))
        return ort.InferenceSession(str(renamed), sess_options=options,
                                    providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types
        text = one_line(exc)
        raise PartitionError(f"cannot run the whole model {model} to check: {text}") from None
    finally:
        renamed.unlink(missing_ok=True)


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
