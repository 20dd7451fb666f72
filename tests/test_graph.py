"""Loading ONNX models as operator DAGs, and stage files for the awkward cases."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.parser
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from support.graphs import CHAIN, feeds_for, save
from support.outputs import assert_same, run_chained, run_whole

from onnx_partition.errors import PartitionError
from onnx_partition.graph import load, node_keys
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime import PipelineSession


def check_exact(model_path, out, feeds):
    expected = run_whole(model_path, feeds)
    assert_same(run_chained(out, feeds), expected)
    session = PipelineSession(out, microbatches=3)
    assert_same(dict(zip(
                    [o.name for o in session.get_outputs()], session.run(None, feeds))), expected)


def test_chain_sizes_keys_and_constants(tmp_path):
    graph = load(save(CHAIN, tmp_path / "m.onnx"), batch_size=3)
    assert [n.key for n in graph.nodes] == ["c", "a", "b", "d", "e", "f", "y"]
    assert [n.key for n in graph.nodes if n.free] == ["c"]
    assert graph.tensors["a"].nbytes == 3 * 4 * 4
    assert graph.tensors["a"].consumers == (2, 6)
    assert graph.tensors["x"].producer == -1
    # the shared weight counts once, for its first reader
    assert [n.param_bytes for n in graph.nodes if not n.free] == [64, 0, 0, 0, 0, 0]
    assert "c" not in graph.tensors  # constants never cross a cut


def test_constants_are_copied_not_sent(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    plan = partition(model, 6, tmp_path / "out", batch_size=3)
    stage_with_mul = next(s for s in plan.stages if "d" in s.nodes)
    assert stage_with_mul.constants == ["c"]
    assert "c" not in stage_with_mul.inputs
    check_exact(model, tmp_path / "out", feeds_for())


def test_constant_of_shape_of_constant_is_free(tmp_path):
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 4] x) => (float[N, 4] y)
    {
      s = Constant<value = int64[1] {4}>()
      z = ConstantOfShape<value = float[1] {0.5}>(s)
      a = Add(x, z)
      b = Relu(a)
      c = Mul(b, z)
      y = Sub(c, x)
    }
    """
    model = save(text, tmp_path / "m.onnx")
    graph = load(model, batch_size=2)
    assert [n.key for n in graph.nodes if n.free] == ["s", "z"]
    plan = partition(model, 4, tmp_path / "out", batch_size=2)
    assert [s.constants for s in plan.stages] == [["s", "z"], [], ["s", "z"], []]
    check_exact(model, tmp_path / "out", feeds_for())


def test_unnamed_and_duplicate_names_get_keys():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name=""),
        helper.make_node("Relu", ["a"], ["b"], name="dup"),
        helper.make_node("Relu", ["b"], ["c"], name="dup"),
        helper.make_node("Relu", ["c"], ["dup"], name=""),
    ]
    assert node_keys(nodes) == ["a", "dup", "c", "dup#1"]


def test_unsorted_file_order_is_sorted(tmp_path):
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])
    nodes = [helper.make_node("Neg", ["a"], ["y"]), helper.make_node("Relu", ["x"], ["a"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    graph = load(tmp_path / "m.onnx", batch_size=2)
    assert [n.key for n in graph.nodes] == ["a", "y"]
    partition(tmp_path / "m.onnx", 2, tmp_path / "out", batch_size=2)
    assert_same(run_chained(tmp_path / "out", feeds_for()), {"y": -np.maximum(feeds_for()["x"], 0)})


def test_if_node_stays_whole_and_captures_count_as_inputs(tmp_path):
    then_branch = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, None)])
    else_branch = helper.make_graph(
        [helper.make_node("Sub", ["a", "b"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Neg", ["x"], ["b"], name="neg"),
        helper.make_node("Greater", ["flag", "zero"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["r"], name="if", then_branch=then_branch,
                         else_branch=else_branch),
        helper.make_node("Mul", ["r", "a"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4]),
                     helper.make_tensor_value_info("flag", onnx.TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    loaded = load(tmp_path / "m.onnx", batch_size=3)
    if_node = next(n for n in loaded.nodes if n.key == "if")
    assert set(if_node.inputs) == {"cond", "a", "b"}
    plan = partition(tmp_path / "m.onnx", 5, tmp_path / "out", batch_size=3)
    assert ["if"] in [s.nodes for s in plan.stages]
    for flag in (-1.0, 1.0):  # the scalar flag is broadcast to every micro-batch
        feeds = {**feeds_for(), "flag": np.array(flag, np.float32)}
        check_exact(tmp_path / "m.onnx", tmp_path / "out", feeds)


def test_old_ir_with_initializers_as_inputs(tmp_path):
    w = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4) / 10, "w")
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4]),
              helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [4, 4])]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w"], ["y"])]
    graph = helper.make_graph(nodes, "old", inputs,
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 4])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 3
    onnx.save(model, str(tmp_path / "m.onnx"))
    assert load(tmp_path / "m.onnx").inputs == ["x"]
    partition(tmp_path / "m.onnx", 3, tmp_path / "out")
    for k in range(3):
        assert onnx.load(str(tmp_path / "out" / f"stage_{k}.onnx")).ir_version >= 4
    feeds = feeds_for()
    expected = {"y": np.maximum(feeds["x"] @ onnx.numpy_helper.to_array(w), 0)
                @ onnx.numpy_helper.to_array(w)}
    assert_same(run_chained(tmp_path / "out", feeds), expected)


def test_external_data_stays_external_and_is_copied_piecewise(tmp_path):
    rng = np.random.default_rng(0)
    big = numpy_helper.from_array(rng.standard_normal((512, 1024)).astype(np.float32), "big")
    small = numpy_helper.from_array(rng.standard_normal((1024, 8)).astype(np.float32), "small")
    nodes = [helper.make_node("MatMul", ["x", "big"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "small"], ["y"], name="mm2")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 512])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8])],
        initializer=[big, small])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    src = tmp_path / "src"
    src.mkdir()
    onnx.save_model(model, str(src / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=1024)
    graph_loaded = load(src / "m.onnx", batch_size=2)
    assert graph_loaded.initializer_bytes == {"big": 512 * 1024 * 4, "small": 1024 * 8 * 4}
    plan = partition(src / "m.onnx", 3, tmp_path / "out", batch_size=2)
    assert plan.model == "../src/m.onnx"
    assert (tmp_path / "out" / "stage_0.onnx.data").stat().st_size >= 512 * 1024 * 4
    assert not (tmp_path / "out" / "stage_2.onnx.data").exists()  # 32 KiB stays inline
    stage0 = onnx.load(str(tmp_path / "out" / "stage_0.onnx"), load_external_data=False)
    assert stage0.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    feeds = {"x": rng.standard_normal((4, 512)).astype(np.float32)}
    check_exact(src / "m.onnx", tmp_path / "out", feeds)


@pytest.mark.parametrize("opset", [9, 11, 13, 15, 17, 18, 19, 20, 21])
def test_opsets(tmp_path, opset):
    text = CHAIN.replace('"" : 17', f'"" : {opset}').replace("ir_version: 8", "ir_version: 10")
    model = onnx.parser.parse_model(text)
    model.ir_version = min(10, onnx.helper.find_min_ir_version_for(list(model.opset_import)))
    onnx.save(model, str(tmp_path / "m.onnx"))
    partition(tmp_path / "m.onnx", 3, tmp_path / "out", batch_size=3)
    check_exact(tmp_path / "m.onnx", tmp_path / "out", feeds_for())


def test_costs_file_overrides_analytic(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    costs = {"format": "onnx-partition/costs@1", "unit": "ms", "device": "cpu",
             "nodes": {"a": {"forward_ms": 100.0}}}
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    plan = partition(model, 2, tmp_path / "out", batch_size=3, costs=tmp_path / "costs.json")
    assert plan.stages[0].nodes == ["a"]  # the heavy node gets a stage of its own
    assert plan.stages[0].predicted is not None
    assert plan.stages[0].predicted.compute_ms == pytest.approx(100.0)
    assert read_plan(tmp_path / "out").extra["costs"]["measured_nodes"] == 1


def test_symbolic_dim_needs_a_value(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    with pytest.raises(PartitionError, match="symbolic; give --batch-size"):
        load(model)
    assert load(model, input_shapes={"x": [5, 4]}).tensors["a"].nbytes == 5 * 4 * 4


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_file_order_is_kept_where_valid_as_networkx_would(data):
    """graph.load's topological order (Kahn's, lowest file position first, written out to keep
    networkx out of every command's imports) equals networkx's lexicographical sort on random
    DAGs whose nodes are listed in a shuffled file order; a cycle is named."""
    import networkx as nx
    from onnx import helper as h

    from onnx_partition.graph.load import _topological_order

    n = data.draw(st.integers(1, 12))
    edges = {(i, j) for j in range(n) for i in range(j)
             if data.draw(st.booleans(), label=f"edge {i}->{j}")}
    perm = data.draw(st.permutations(range(n)))  # file position of topological node k
    nodes = [None] * n
    for k in range(n):
        ins = [f"t{i}" for i in range(k) if (i, k) in edges] or ["x"]
        nodes[perm[k]] = h.make_node("Sum", ins, [f"t{k}"], name=f"n{k}")
    graph = h.make_graph(nodes, "g", [], [])
    keys = [nd.name for nd in nodes]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(n))
    dag.add_edges_from((perm[i], perm[j]) for i, j in edges)
    assert _topological_order(graph, keys, {"x"}) == list(nx.lexicographical_topological_sort(dag))
    looped = h.make_graph([h.make_node("Sum", ["b"], ["a"], name="A"),
                           h.make_node("Sum", ["a"], ["b"], name="B")], "g", [], [])
    with pytest.raises(PartitionError, match="the graph has a cycle: A -> B -> A"):
        _topological_order(looped, ["A", "B"], set())
