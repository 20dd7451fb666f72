"""Each rule of the pipeline model has one home (issue 19): the tests that hold each merge.

Every merged rule is checked against the form it replaced, written out here as it was."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.pipeline import memory, schedules
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
    assert schedules.NAMES == ("gpipe", "1f1b", "zb-h1", "interleaved", "infer")
    assert schedules.TRAIN_NAMES == ("gpipe", "1f1b", "zb-h1")
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
    builders = re.compile(r"\b(gpipe|one_f_one_b|zb_h1|interleaved|inference)\(")
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.name != "schedules.py" and builders.search(p.read_text())]
    assert found == []


# ------------------------------------------------------------------ memory closed form


def _old_hybrid_held(lookup, next_reps, next_warm, m, last):
    """solve/hybrid.py's ``_held`` before it moved to pipeline.memory, verbatim."""
    r = lookup.astype(np.int64)[:, None]
    if last:
        steps = np.zeros((len(r), len(next_reps)), dtype=np.int64)
    else:
        after = np.maximum(next_reps, 1)[None, :]
        divides = (r % after == 0) | (after % r == 0)
        steps = np.where(divides, np.maximum(r, after), r + after - 1)
    warmup = np.minimum(steps + next_warm[None, :], m)
    return (-(-np.minimum(warmup + 1, m) // r)).astype(np.int16), steps


@settings(max_examples=150, deadline=None)
@given(lookup=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       suffix=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 60)), min_size=1,
                       max_size=8),
       m=st.integers(1, 64), last=st.booleans())
def test_vectorised_held_equals_the_old_table_and_the_scalar_form(lookup, suffix, m, last):
    lookup = np.asarray([*lookup, 16000], dtype=np.int16)  # the DP's "no count" entry too
    next_reps = np.asarray([r for r, _ in suffix], dtype=np.int64)
    next_warm = np.minimum(np.asarray([w for _, w in suffix], dtype=np.int64), m)
    held, steps = memory.held_in_front(lookup, next_reps, next_warm, m, last=last)
    old_held, old_steps = _old_hybrid_held(lookup, next_reps, next_warm, m, last)
    np.testing.assert_array_equal(held, old_held)
    np.testing.assert_array_equal(steps, old_steps)
    # the scalar closed form: the stage in front of a real suffix of that shape
    for c, j in itertools.product(range(len(lookup) - 1), range(len(suffix))):
        if last or next_reps[j] < 1:
            continue
        d, after = int(lookup[c]), int(next_reps[j])
        assert steps[c, j] == memory.boundary_step(d, after)
        warm = min(memory.boundary_step(d, after) + int(next_warm[j]), m)
        assert held[c, j] == -(-min(warm + 1, m) // d)


@settings(max_examples=100, deadline=None)
@given(replicas=st.lists(st.integers(1, 6), min_size=1, max_size=6), m=st.integers(1, 30))
def test_vectorised_held_walked_from_the_end_equals_peak_inflight(replicas, m):
    """Building a pipeline from its end with held_in_front gives peak_inflight's counts."""
    p = len(replicas)
    held = [0] * p
    warm, nxt = 0, 1
    for s in range(p - 1, -1, -1):
        h, steps = memory.held_in_front(np.asarray([replicas[s]]), np.asarray([nxt]),
                                        np.asarray([warm]), m, last=s == p - 1)
        held[s] = int(h[0, 0])
        warm, nxt = min(int(steps[0, 0]) + warm, m), replicas[s]
    assert held == memory.peak_inflight("1f1b", replicas, m)


# ------------------------------------------------------------------ micro-batch default


def test_the_microbatch_default_has_one_home():
    """Plan.microbatches / Plan.rows_per_microbatch are read everywhere; nobody else reads
    predicted.microbatches with a default of its own."""
    import pathlib

    from onnx_partition.pipeline import predict

    assert not hasattr(predict, "plan_microbatches") and not hasattr(predict, "plan_batch_size")
    root = pathlib.Path(__file__).resolve().parents[1] / "onnx_partition"
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.parent.name != "plan" and 'predicted.get("microbatches"' in p.read_text()]
    assert found == []


# ------------------------------------------------------------------ routing, layout, relay


def test_routing_layout_and_relay_sets_have_one_home():
    from onnx_partition.pipeline.layout import layout, needed_after, replica_of
    from onnx_partition.plan import IOSpec, Plan, Stage

    assert [replica_of(m, 3) for m in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # x read by stages 0 and 2; a made by 0, read by 2 (a skip); b made by 1
    stages = [Stage(0, "s0", [], ["x"], ["a"], replicas=2, devices=["cpu", "cpu"]),
              Stage(1, "s1", [], ["a"], ["b"]),
              Stage(2, "s2", [], ["a", "b", "x"], ["y"], replicas=3)]
    plan = Plan("m.onnx", stages, [IOSpec("x", "float", ["N", 2])],
                [IOSpec("y", "float", ["N", 2])])
    assert needed_after(plan) == [{"a", "b", "x", "y"}, {"a", "b", "x", "y"}, {"y"}]
    lay = layout(plan)
    assert lay.first == [0, 2, 3] and lay.world_size == 6
    assert lay.recv_names == [["x"], ["a", "x"], ["a", "b", "x"]]
    assert lay.send_names == [["a", "x"], ["a", "b", "x"], ["y"]]
    assert [lay.rank_of(2, m) for m in range(4)] == [3, 4, 5, 3]
    # the schedules route by the same rule
    sched = schedules.build("1f1b", [2, 1, 3], 6)
    for (stage, r), actions in sched.items():
        assert all(replica_of(a.microbatch, [2, 1, 3][stage]) == r for a in actions)


# ------------------------------------------------------------------ random feeds


def test_random_feeds_have_one_home(tmp_path):
    from onnx_partition.cli import verbs
    from onnx_partition.plan import IOSpec, Plan, Stage
    from onnx_partition.runtime.infer.check import random_feeds, run_feeds

    assert not hasattr(verbs, "run_feeds")
    plan = Plan("m.onnx", [Stage(0, "s0", [], ["x", "ids"], ["y"])],
                [IOSpec("x", "float32", ["N", 3]), IOSpec("ids", "int64", ["N"], high=7)],
                [IOSpec("y", "float32", ["N", 3])])
    drawn = random_feeds(plan, batch_size=5, seed=4)
    given = run_feeds(plan, [], rows=5, seed=4)
    assert drawn.keys() == given.keys()
    for name in drawn:
        np.testing.assert_array_equal(drawn[name], given[name])
    assert drawn["x"].shape == (5, 3) and drawn["ids"].max() < 7
    np.save(tmp_path / "x.npy", np.ones((5, 3), np.float32))
    assert (run_feeds(plan, [f"x={tmp_path / 'x.npy'}"], rows=5, seed=4)["x"] == 1).all()


# ------------------------------------------------------------------ the split rule


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 40), chunks=st.integers(1, 50))
def test_one_split_rule_for_numpy_torch_and_the_reference(rows, chunks):
    import torch

    from onnx_partition.pipeline import microbatch
    from onnx_partition.runtime.train.rank_io import microbatch as rank_microbatch
    from onnx_partition.runtime.train.reference import split_rows

    ranges = microbatch.row_ranges(rows, chunks)
    assert len(ranges) == min(rows, chunks) and ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(lo < hi and hi == nxt for (lo, hi), (nxt, _) in itertools.pairwise(ranges))
    assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1
    assert split_rows(rows, chunks) == ranges
    x = np.arange(rows * 2).reshape(rows, 2)
    parts = microbatch.split({"x": x, "s": np.array(1.0)}, chunks)
    assert [(int(p["x"][0, 0]) // 2, int(p["x"][-1, 0]) // 2 + 1) for p in parts] == ranges
    np.testing.assert_array_equal(microbatch.merge([{"x": p["x"]} for p in parts])["x"], x)
    t = torch.arange(rows * 2).reshape(rows, 2)
    for m, (lo, hi) in enumerate(ranges):
        assert torch.equal(rank_microbatch({"x": t}, m, len(ranges))["x"], t[lo:hi])
        np.testing.assert_array_equal(microbatch.rows_of({"x": x}, m, len(ranges))["x"],
                                      x[lo:hi])
    if rows % chunks == 0:  # a training step: micro-batch m is rows m B .. (m + 1) B
        b = rows // chunks
        assert ranges == [(m * b, (m + 1) * b) for m in range(chunks)]
        # the training ranks' old rule (torch.tensor_split) agrees there
        assert [tuple(p.shape) for p in t.tensor_split(chunks)] == [
            (hi - lo, 2) for lo, hi in ranges]


# ------------------------------------------------------------------ backward from forward


def test_backward_from_forward_is_one_rule():
    import pathlib
    import re

    from onnx_partition.cost import analytic
    from onnx_partition.pipeline.simulate import backward_factor

    assert backward_factor(True) == 2.0 and backward_factor(False) == 1.0
    assert backward_factor() == 2.0  # class not known: the figures the old copies used
    for op in ["MatMul", "Gemm", "Conv", "Add", "Relu", "LayerNormalization", "Reshape"]:
        assert analytic.backward_factor(op) == (2.0 if op in analytic.DENSE else 1.0)
        assert analytic.backward_factor(op) == backward_factor(op in analytic.DENSE)
    assert analytic.backward_factor(None) == 2.0
    root = pathlib.Path(__file__).resolve().parents[1] / "onnx_partition"
    text = "\n".join(p.read_text() for p in root.rglob("*.py"))
    assert "BACKWARD_RATIO" not in text
    assert not re.search(r"get\(\"backward_ms\", 2\.0", text)


def test_a_costs_file_without_backward_keeps_twice_the_forward(tmp_path):
    import json

    from support.graphs import CHAIN, save

    from onnx_partition.cost.annotate import annotate
    from onnx_partition.graph import load

    graph = load(save(CHAIN, tmp_path / "m.onnx"), batch_size=2)
    first = next(n for n in graph.nodes if not n.free)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": "onnx-partition/costs@1", "unit": "ms",
                                 "nodes": {first.key: {"forward_ms": 0.3}}}))
    node_costs = annotate(graph, costs=costs)
    assert node_costs.backward_ms[first.index] == 2.0 * 0.3


# ------------------------------------------------------------------ stage comm encoding


@settings(max_examples=200, deadline=None)
@given(sends=st.lists(st.integers(0, 2**20), min_size=0, max_size=12),
       train=st.booleans())
def test_send_times_invert_stage_comm_exactly(sends, train):
    from onnx_partition.pipeline.from_plan import comm_factor, send_times, stage_comm

    exact = [s / 1024 for s in sends]  # dyadic: every sum and difference is exact
    factor = comm_factor(train)
    comm = stage_comm(exact, factor)
    assert len(comm) == len(exact) + 1
    assert send_times(comm, factor) == exact


@settings(max_examples=200, deadline=None)
@given(sends=st.lists(st.floats(0, 1e3), min_size=1, max_size=12), train=st.booleans())
def test_send_times_invert_stage_comm_to_rounding(sends, train):
    from onnx_partition.pipeline.from_plan import comm_factor, send_times, stage_comm

    factor = comm_factor(train)
    back = send_times(stage_comm(sends, factor), factor)
    scale = max(sends)
    assert all(abs(a - b) <= 1e-12 * max(scale, 1.0) * len(sends) for a, b in zip(back, sends))
    # plan.json keeps comm_ms to 6 decimals: the sends come back to that
    written = [round(c, 6) for c in stage_comm(sends, factor)]
    back = send_times(written, factor)
    assert all(abs(a - b) <= 1e-6 * len(sends) for a, b in zip(back, sends))


def test_partition_writes_comm_by_stage_comm(tmp_path):
    import json

    from support.graphs import CHAIN, save

    from onnx_partition.cost.cluster import Cluster, Link
    from onnx_partition.partition import partition
    from onnx_partition.pipeline.from_plan import send_times, stage_comm

    model = save(CHAIN, tmp_path / "m.onnx")
    cluster = Cluster(2, 2, intra=Link(0.002, 0.01), inter=Link(0.001, 0.3))
    partition(model, 3, tmp_path / "p", batch_size=4, cluster=cluster, mode="train")
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    sends = plan["simulator_costs"]["send_ms"]
    comm = [s["predicted"]["comm_ms"] for s in plan["stages"]]
    assert comm == [round(c, 6) for c in stage_comm(sends, 2.0)]
    assert send_times(comm, 2.0) == pytest.approx(sends, abs=1e-5)
