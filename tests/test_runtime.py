"""The threaded runtime: micro-batching, replicas, failures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.graphs import CHAIN, gather_model, save
from support.outputs import assert_same, run_whole

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.graph.ort import local_device, providers_for
from onnx_partition.partition import partition
from onnx_partition.pipeline import microbatch
from onnx_partition.runtime import PipelineSession, StageFailed


@given(rows=st.integers(1, 9), chunks=st.integers(1, 12))
def test_split_and_merge_are_inverse(rows, chunks):
    feeds = {"a": np.arange(rows * 2).reshape(rows, 2), "s": np.array(3.0)}
    parts = microbatch.split(feeds, chunks)
    assert len(parts) == min(rows, chunks)
    assert all(p["s"] == 3.0 for p in parts)
    assert all(len(p["a"]) >= 1 for p in parts)
    np.testing.assert_array_equal(microbatch.merge([{"a": p["a"]} for p in parts])["a"], feeds["a"])


def test_split_rejects_disagreeing_batches():
    with pytest.raises(ValueError, match="disagree"):
        microbatch.split({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))}, 2)


def test_replicas_take_microbatches_in_turn(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    partition(model, 3, tmp_path / "out", batch_size=2)
    plan_file = tmp_path / "out" / "plan.json"
    plan = json.loads(plan_file.read_text())
    plan["stages"][1]["replicas"] = 3
    plan["stages"][1]["devices"] = ["cpu", "cpu", "cpu"]
    plan_file.write_text(json.dumps(plan))
    feeds = {"x": np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)}
    with PipelineSession(tmp_path / "out", microbatches=7) as session:
        assert len(session.stages[1]) == 3
        outputs = dict(zip(
                    [o.name for o in session.get_outputs()], session.run(None, feeds)))
        assert_same(outputs, run_whole(model, feeds))
        busy = session.last_stats.busy_ms
        assert set(busy) == {(0, 0), (1, 0), (1, 1), (1, 2), (2, 0)}
        assert all(ms > 0 for ms in busy.values())


def test_a_failing_stage_fails_the_run_naming_it(tmp_path):
    partition(gather_model(tmp_path / "m.onnx"), 3, tmp_path / "out", batch_size=2)
    session = PipelineSession(tmp_path / "out", microbatches=2, timeout_s=30)
    assert session.plan.inputs[1].high == 5  # random feeds keep ids below the table size
    x = np.ones((4, 4), np.float32)
    with pytest.raises(StageFailed, match=r"stage \d replica 0 \(cpu\) failed"):
        session.run(None, {"x": x, "ids": np.array([0, 1, 99, 2])})
    # the workers keep serving after a failure
    (y,) = session.run(None, {"x": x, "ids": np.array([0, 1, 4, 2])})
    np.testing.assert_array_equal(y[2], 1 + np.arange(16, 20, dtype=np.float32))
    session.close()
    with pytest.raises(PartitionError, match="closed"):
        session.run(None, {"x": x, "ids": np.array([0, 1, 4, 2])})


def test_run_checks_names(tmp_path):
    partition(gather_model(tmp_path / "m.onnx"), 2, tmp_path / "out", batch_size=2)
    with PipelineSession(tmp_path / "out") as session:
        with pytest.raises(PartitionError, match="missing input 'ids'"):
            session.run(None, {"x": np.ones((2, 4), np.float32)})
        with pytest.raises(PartitionError, match="unknown output 'z'"):
            session.run(["z"], {"x": np.ones((2, 4), np.float32), "ids": np.zeros(2, np.int64)})


def test_a_plan_for_two_machines_runs_here(tmp_path):
    """Devices of a multi-machine plan carry their machine (m1/cpu); each machine runs its own
    ranks, so the runtime uses the local device, and one machine can run the whole plan."""
    model = save(CHAIN, tmp_path / "m.onnx")
    cluster = Cluster(2, 1, kind="cpu", intra=Link(10.0, 0.0), inter=Link(100.0, 0.0))
    plan = partition(model, 2, tmp_path / "out", batch_size=2, cluster=cluster)
    assert [s.devices for s in plan.stages] == [["m0/cpu"], ["m1/cpu"]]
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)}
    (got,) = PipelineSession(tmp_path / "out", microbatches=2).run(None, feeds)
    assert_same({"y": got}, run_whole(model, feeds))


def test_local_device_names() -> None:
    assert local_device("m12/cuda:3") == "cuda:3"
    assert local_device("cuda:1") == "cuda:1" and local_device("cpu") == "cpu"
    assert providers_for("m1/cpu") == ["CPUExecutionProvider"]
    with pytest.raises(PartitionError, match="unknown device 'mx/cpu'"):
        providers_for("mx/cpu")


def test_a_failing_stage_keeps_onnxruntimes_exception_as_the_cause(tmp_path):
    partition(gather_model(tmp_path / "m.onnx"), 3, tmp_path / "out", batch_size=2)
    feeds = {"x": np.ones((2, 4), np.float32), "ids": np.array([0, 99])}
    with (PipelineSession(tmp_path / "out", microbatches=1, timeout_s=30) as session,
          pytest.raises(StageFailed) as failed):
        session.run(None, feeds)
    cause = failed.value.__cause__
    assert cause is not None and not isinstance(cause, StageFailed)
    assert str(failed.value).endswith(str(cause).strip().splitlines()[0])
