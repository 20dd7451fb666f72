"""The multi-process runtime: real gloo process groups on loopback, one process per replica."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from support.faults import ExitAt
from support.graphs import CHAIN, SKIP, gather_model, save
from support.outputs import assert_same, run_whole

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime import StageFailed
from onnx_partition.runtime.infer.processes import (
    Layout,
    choose_backend,
    layout,
    run_distributed,
)
from onnx_partition.runtime.wire import SMALL_BYTES


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def named(plan_dir, outputs):
    """run_distributed's list (in the plan's output order, as onnxruntime) by output name."""
    return dict(zip([o.name for o in read_plan(plan_dir).outputs], outputs))


def partition_skip(tmp_path: Path) -> Path:
    """SKIP in three stages, {a, b, c} | {d} | {e, f, y}: costs that make it the one balanced
    split, so the layout below does not hang on how the DP breaks ties."""
    costs = {"format": "onnx-partition/costs@1", "unit": "ms", "device": "cpu",
             "nodes": {k: {"forward_ms": 3.0 if k == "d" else 1.0} for k in "abcdefy"}}
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    model = save(SKIP, tmp_path / "m.onnx")
    partition(model, 3, tmp_path / "out", batch_size=2, costs=tmp_path / "costs.json")
    return model


def test_layout_relays_skips_and_late_inputs(tmp_path):
    partition_skip(tmp_path)
    lay = layout(read_plan(tmp_path / "out"))
    assert lay.recv_names == [["x", "z"], ["a", "c", "z"], ["a", "d", "z"]]
    assert lay.send_names[-1] == ["y"]
    assert [lay.place(q) for q in range(3)] == [(0, 0), (1, 0), (2, 0)]


def test_two_stages_equal_the_whole_model(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    partition(model, 2, tmp_path / "out", batch_size=2)
    feeds = {"x": rows(9001)}  # micro-batches of 4500 rows: 72 KB tensors, sent on their own
    assert SMALL_BYTES <= 4500 * 4 * 4
    outputs, stats = run_distributed(tmp_path / "out", feeds, nproc=2, microbatches=2,
                                     iterations=2, timeout_s=60)
    assert_same(named(tmp_path / "out", outputs), run_whole(model, feeds))
    assert stats.backend == "gloo" and stats.microbatches == 2 and stats.rows == 9001
    assert stats.placement == [(0, 0, "cpu"), (1, 0, "cpu")]
    assert len(stats.throughput_per_s()) == 2 and all(t > 0 for t in stats.throughput_per_s())
    assert all(0 < stats.busy_ms[q] <= stats.wall_ms[q] for q in range(2))  # busy within wall
    assert stats.idle_ms() == pytest.approx({q: stats.wall_ms[q] - stats.busy_ms[q]
                                             for q in range(2)})


SCALAR = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y, float z)
{
  r = Relu(x)
  s = ReduceSum<keepdims = 0>(r)
  t = Tanh(r)
  y = Mul(t, s)
  z = Neg(s)
}
"""


def test_a_0d_output_stays_0d_across_ranks(tmp_path):
    model = save(SCALAR, tmp_path / "m.onnx")
    partition(model, 2, tmp_path / "out", batch_size=2)
    feeds = {"x": rows(4)}
    outputs, _ = run_distributed(tmp_path / "out", feeds, nproc=2, microbatches=1, timeout_s=60)
    whole = run_whole(model, feeds)
    assert whole["z"].shape == ()
    assert_same(named(tmp_path / "out", outputs), whole)


def test_spawned_workers(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    partition(model, 1, tmp_path / "out", batch_size=2)  # one rank: spawn imports torch per rank
    feeds = {"x": rows(5)}
    outputs, stats = run_distributed(tmp_path / "out", feeds, microbatches=2, start_method="spawn")
    assert_same(named(tmp_path / "out", outputs), run_whole(model, feeds))
    assert stats.world_size == 1 and stats.microbatches == 2


def test_replicated_stage_with_skip_and_late_input(tmp_path):
    model = partition_skip(tmp_path)
    plan_file = tmp_path / "out" / "plan.json"
    plan = json.loads(plan_file.read_text())
    assert [s["inputs"] for s in plan["stages"]] == [["x"], ["c"], ["d", "a", "z"]]
    plan["stages"][1]["replicas"] = 2
    plan["stages"][1]["devices"] = ["cpu", "cpu"]
    plan_file.write_text(json.dumps(plan))
    feeds = {"x": rows(6), "z": rows(6, seed=1)}
    outputs, stats = run_distributed(tmp_path / "out", feeds, microbatches=5, timeout_s=60)
    assert_same(named(tmp_path / "out", outputs), run_whole(model, feeds))
    assert [p[:2] for p in stats.placement] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert stats.busy_ms[1] > 0 and stats.busy_ms[2] > 0  # both replicas served


def test_a_plan_straight_from_the_hybrid_planner(tmp_path):
    """No hand edits: the planner chooses stages and replicas on a 4-device CPU cluster
    (two stages forced, so some stage gets replicas), the runtime starts a rank per replica,
    and the outputs equal the whole model's."""
    model = save(SKIP, tmp_path / "m.onnx")
    cluster = Cluster(1, 4, kind="cpu", intra=Link(100.0, 0.0))
    plan = partition(model, 2, tmp_path / "out", batch_size=2, cluster=cluster,
                     microbatches=6)
    replicas = [s.replicas for s in plan.stages]
    assert len(replicas) == 2 and sum(replicas) > 2
    feeds = {"x": rows(6), "z": rows(6, seed=1)}
    outputs, stats = run_distributed(tmp_path / "out", feeds, microbatches=6, timeout_s=60)
    assert_same(named(tmp_path / "out", outputs), run_whole(model, feeds))
    assert stats.world_size == sum(replicas)


def test_a_raising_stage_fails_the_run_quickly(tmp_path):
    partition(gather_model(tmp_path / "m.onnx"), 2, tmp_path / "out", batch_size=2)
    stage = next(s.index for s in read_plan(tmp_path / "out").stages if "gather" in s.nodes)
    feeds = {"x": np.ones((4, 4), np.float32), "ids": np.array([0, 1, 99, 2])}
    began = time.perf_counter()
    with pytest.raises(StageFailed, match=rf"stage {stage} replica 0 \(rank {stage}, cpu\) "
                                          r"failed: .*"):
        run_distributed(tmp_path / "out", feeds, microbatches=2, timeout_s=60)
    assert time.perf_counter() - began < 30  # a hang would last the 60 s timeout


def test_a_dying_worker_fails_the_run_quickly(tmp_path):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "out", batch_size=2)
    began = time.perf_counter()
    with pytest.raises(StageFailed, match=r"stage 1 replica 0 \(rank 1, cpu\) exited with code 1"):
        run_distributed(tmp_path / "out", {"x": rows(4)}, microbatches=2, timeout_s=60,
                        hook=ExitAt(1, "compute"))
    assert time.perf_counter() - began < 30


def test_bad_requests_fail_before_any_process_starts(tmp_path):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "out", batch_size=2)
    out = tmp_path / "out"
    with pytest.raises(PartitionError, match=r"2 stage replicas .* got 3 processes"):
        run_distributed(out, {"x": rows(2)}, nproc=3)
    with pytest.raises(PartitionError, match="missing input 'x'"):
        run_distributed(out, {}, nproc=2)
    with pytest.raises(PartitionError, match="backend nccl"):
        run_distributed(out, {"x": rows(2)}, backend="nccl")
    (out / "stage_1.onnx").write_bytes((out / "stage_1.onnx").read_bytes() + b"\0")
    with pytest.raises(PartitionError, match="manifest says"):
        run_distributed(out, {"x": rows(2)})
    (out / "stage_1.onnx").unlink()
    with pytest.raises(PartitionError, match="missing"):
        run_distributed(out, {"x": rows(2)})


def test_nccl_needs_distinct_local_devices():
    """m0/cuda:0 and m1/cuda:0 are two GPUs under torchrun on two machines, one GPU when a
    single machine runs every rank."""
    lay = Layout([1, 1], [0, 1], [["m0/cuda:0"], ["m1/cuda:0"]], [["x"], ["a"]], [["a"], ["y"]])
    assert choose_backend(lay, "nccl") == "nccl"
    with pytest.raises(PartitionError, match="own cuda:N"):
        choose_backend(lay, "nccl", one_machine=True)
    cpu = Layout([1, 1], [0, 1], [["m0/cpu"], ["m1/cpu"]], [["x"], ["a"]], [["a"], ["y"]])
    assert choose_backend(cpu, None) == "gloo"
