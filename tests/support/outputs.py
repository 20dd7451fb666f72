"""Reference runs for the runtimes' outputs: the whole model, the stages chained one after
another, and the comparison every runtime test makes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_partition.plan import read_plan

__all__ = ["assert_same", "run_chained", "run_whole", "session"]


def session(path: Path | str) -> ort.InferenceSession:
    """A one-thread CPU session of the model at ``path``."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_whole(model: Path | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of the whole model, by name."""
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def run_chained(plan_dir: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the stages one after another on the whole batch: no threads, no micro-batches."""
    plan = read_plan(plan_dir)
    env = dict(feeds)
    for stage in plan.stages:
        sess = session(plan_dir / stage.file)
        assert [i.name for i in sess.get_inputs()] == stage.inputs
        env.update(zip(stage.outputs, sess.run(stage.outputs, {n: env[n] for n in stage.inputs})))
    return {o.name: env[o.name] for o in plan.outputs}


def assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """Outputs equal the whole model's: max relative error <= 1e-5 (relative to max |expected|)."""
    assert set(actual) == set(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, name
        if np.issubdtype(want.dtype, np.floating):
            scale = float(np.max(np.abs(want))) if want.size else 1.0
            assert float(np.max(np.abs(got - want), initial=0.0)) <= 1e-5 * max(scale, 1e-30), name
        else:
            np.testing.assert_array_equal(got, want)
