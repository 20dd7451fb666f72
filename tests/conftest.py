"""Shared fixtures: recipe exports cached for the session, and a chained (unpipelined) runner."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import settings

from onnx_partition.plan import read_plan

# Property tests: no per-example deadline (CI machines are slow and shared); in CI the examples
# are derived from each test's name, so a run is reproducible and a failure can be replayed.
settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``exported(name, size)``: the recipe's ONNX file, exported once per test session."""
    from onnx_partition import models

    root = tmp_path_factory.mktemp("recipes")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, size: str = "tiny") -> Path:
        if (name, size) not in cache:
            cache[name, size] = models.export(name, root / f"{name}-{size}.onnx", size=size)
        return cache[name, size]

    return get


def session(path: Path | str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_whole(model: Path | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
