"""Each rule of the pipeline model has one home (issue 19): the tests that hold each merge.

Every merged rule is checked against the form it replaced, written out here as it was."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.schedules import (
    ScheduleError,
    gpipe,
    inference,
    interleaved,
    one_f_one_b,
)

# ------------------------------------------------------------------ schedule registry


def _old_dispatch(name: str, replicas: list[int], m: int, chunks: int | None):
    """from_plan.simulate_plan's if/elif chain before the registry (train.rank's and the
    scorer's were subsets of it)."""
    if name == "gpipe":
        return gpipe(len(replicas), m, replicas)
    if name == "1f1b":
        return one_f_one_b(len(replicas), m, replicas)
    if name == "interleaved":
        return interleaved(len(replicas), m, 2 if chunks is None else chunks, replicas)
    return inference(len(replicas), m, replicas)


@settings(max_examples=80, deadline=None)
@given(replicas=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       m=st.integers(1, 12), name=st.sampled_from(["gpipe", "1f1b", "infer"]))
def test_registry_builds_the_old_action_lists(replicas, m, name):
    assert schedules.build(name, replicas, m) == _old_dispatch(name, replicas, m, None)
    assert schedules.build(name.upper(), replicas, m) == _old_dispatch(name, replicas, m, None)


@pytest.mark.parametrize("stages,chunks,reps,m", [(4, 2, 1, 4), (6, 3, 2, 8), (4, None, 1, 2),
                                                  (3, 1, 1, 5)])
def test_registry_builds_the_old_interleaved_lists(stages, chunks, reps, m):
    replicas = [reps] * stages
    assert (schedules.build("interleaved", replicas, m, chunks=chunks)
            == _old_dispatch("interleaved", replicas, m, chunks))


def test_registry_names_and_refusals():
    assert schedules.NAMES == ("gpipe", "1f1b", "interleaved", "infer")
    assert set(schedules.TRAIN_NAMES) <= set(schedules.NAMES)
    with pytest.raises(ScheduleError, match="unknown schedule 'zigzag'"):
        schedules.build("zigzag", [1], 1)
    with pytest.raises(ScheduleError, match="only to the interleaved"):
        schedules.build("1f1b", [1, 1], 2, chunks=2)


def test_every_caller_uses_the_registry():
    """No module outside schedules.py picks a builder by name."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "onnx_partition"
    builders = re.compile(r"\b(gpipe|one_f_one_b|interleaved|inference)\(")
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.name != "schedules.py" and builders.search(p.read_text())]
    assert found == []
