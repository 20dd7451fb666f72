"""Property tests on random DAGs built as ONNX graphs of cheap ops.

Branches, long skips, several inputs and outputs, constants and dead ends. For every cut: each node
in exactly one stage (constants aside), no tensor flowing backwards, outputs equal the whole model.
"""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper
from support.outputs import assert_same, run_chained, run_whole

from onnx_partition.graph import load
from onnx_partition.partition import Link, partition
from onnx_partition.runtime import PipelineSession

UNARY = ["Relu", "Neg", "Sigmoid", "Tanh", "Abs", "Identity"]
BINARY = ["Add", "Mul", "Sub", "Max"]
WIDTH = 4


@st.composite
def random_dags(draw: st.DrawFn) -> onnx.ModelProto:
    n_inputs = draw(st.integers(1, 3))
    available = [f"in{i}" for i in range(n_inputs)]
    nodes = []
    for i in range(draw(st.integers(2, 14))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "const", "fill"]))
        pick = st.sampled_from(available)
        out = f"t{i}"
        if kind == "unary":
            nodes.append(helper.make_node(draw(st.sampled_from(UNARY)), [draw(pick)], [out]))
        elif kind == "binary":
            op = draw(st.sampled_from(BINARY))
            nodes.append(helper.make_node(op, [draw(pick), draw(pick)], [out]))
        elif kind == "const":  # a Constant node feeding an Add: copied, never sent
            value = helper.make_tensor(f"v{i}", onnx.TensorProto.FLOAT, [WIDTH],
                                       [float(draw(st.integers(-2, 2)))] * WIDTH)
            nodes.append(helper.make_node("Constant", [], [f"c{i}"], value=value))
            nodes.append(helper.make_node("Add", [draw(pick), f"c{i}"], [out]))
        else:  # ConstantOfShape of a Constant: a constant-only subgraph
            shape = helper.make_tensor(f"s{i}", onnx.TensorProto.INT64, [1], [WIDTH])
            nodes.append(helper.make_node("Constant", [], [f"s{i}"], value=shape))
            fill = helper.make_tensor(f"f{i}", onnx.TensorProto.FLOAT, [1], [0.5])
            nodes.append(helper.make_node("ConstantOfShape", [f"s{i}"], [f"z{i}"], value=fill))
            nodes.append(helper.make_node("Mul", [draw(pick), f"z{i}"], [out]))
        available.append(out)
    made = [a for a in available if a.startswith("t")]
    extra = draw(st.lists(st.sampled_from(made), max_size=2, unique=True))
    outputs = list(dict.fromkeys([made[-1], *extra]))
    graph = helper.make_graph(
        nodes, "random",
        [helper.make_tensor_value_info(f"in{i}", onnx.TensorProto.FLOAT, ["N", WIDTH])
         for i in range(n_inputs)],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, ["N", WIDTH]) for o in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(model=random_dags(), data=st.data())
def test_random_dags_cut_exactly(tmp_path_factory, model, data):
    root = tmp_path_factory.mktemp("dag")
    path = root / "m.onnx"
    onnx.save(model, str(path))
    graph = load(path, batch_size=3)
    compute = [n.key for n in graph.nodes if not n.free]
    stages = data.draw(st.integers(1, min(5, len(compute))), label="stages")
    link = data.draw(st.sampled_from([Link(0.0, 0.0), Link(1e-6, 0.0), Link(10.0, 0.02)]))
    plan = partition(path, stages, root / "out", batch_size=3, link=link)

    placed = [key for s in plan.stages for key in s.nodes]
    assert sorted(placed) == sorted(compute), "every node in exactly one stage"
    assert all(s.nodes for s in plan.stages)
    available = {f"in{i}" for i in range(len(graph.inputs))}
    for stage in plan.stages:
        assert set(stage.inputs) <= available, "no tensor flows from a later stage"
        available |= set(stage.outputs)
    assert {o.name for o in plan.outputs} <= available

    rng = np.random.default_rng(0)
    feeds = {name: rng.uniform(-1, 1, (3, WIDTH)).astype(np.float32) for name in graph.inputs}
    expected = run_whole(path, feeds)
    assert_same(run_chained(root / "out", feeds), expected)
    session = PipelineSession(root / "out", microbatches=2)
    assert_same(dict(zip(
                    [o.name for o in session.get_outputs()], session.run(None, feeds))), expected)
