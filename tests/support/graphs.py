"""Small ONNX models the tests partition and run, written from text or built by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
from onnx import helper, numpy_helper

__all__ = ["CHAIN", "SKIP", "feeds_for", "gather_model", "relay_model", "save"]

# six operators in a line, a free Constant (copied into the stages that need it, never sent),
# and tensors read again later (x by the Add, a by the last Add)
CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y) <float[4,4] w = {1.0,2,0,0, 0,1,0,0, 0,0,1,0, 0,0,3,1}>
{
  c = Constant<value = float[1] {2.0}>()
  a = MatMul(x, w)
  b = Relu(a)
  d = Mul(b, c)
  e = Add(d, x)
  f = MatMul(e, w)
  y = Add(f, a)
}
"""

# a skips stage 1; z is a graph input read only by the last stage
SKIP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x, float[N, 4] z) => (float[N, 4] y)
  <float[4,4] w = {1.0,2,0,0, 0,1,0,0, 0,0,1,0, 0,0,3,1}>
{
  a = MatMul(x, w)
  b = Relu(a)
  c = MatMul(b, w)
  d = Tanh(c)
  e = Add(d, a)
  f = MatMul(e, w)
  y = Mul(f, z)
}
"""


def save(text: str, path: Path) -> Path:
    """The ONNX model in ``text`` (ONNX's textual syntax) written to ``path``."""
    model = onnx.parser.parse_model(text)
    onnx.save(model, str(path))
    return path


def feeds_for(n: int = 3, width: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ``x`` of ``n`` rows for CHAIN."""
    return {"x": np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)}


def gather_model(path: Path) -> Path:
    """y = Relu(x) + table[ids] with a 5-row table: ids of 5 or more make the Gather stage
    fail."""
    table = numpy_helper.from_array(np.arange(20, dtype=np.float32).reshape(5, 4), "table")
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Gather", ["table", "ids"], ["g"], name="gather"),
             helper.make_node("Add", ["a", "g"], ["y"], name="add")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4]),
                     helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
        initializer=[table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def relay_model(rng: np.random.Generator) -> onnx.ModelProto:
    """A random model of 3 to 9 operators over ``[2, 4]`` floats with every way a stage holds
    bytes: tensors read again several operators later (relayed through the stages between),
    a graph input read late (``x1``) and one never read (``unused``), weights read by several
    MatMuls (tied: each stage reading one holds it), constants copied into every stage that
    reads them (a ``Constant`` and a free node over a small initializer, ``k``), graph outputs
    made before the last operator, and sometimes an initializer or a constant that is itself a
    graph output (held by the last stage file)."""
    def floats(shape: list[int], name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    flow = ["x0"]
    weights = [f"w{i}" for i in range(int(rng.integers(1, 4)))]
    nodes = [helper.make_node("Constant", [], ["c0"], name="const",
                              value=floats([1], "c0")),
             helper.make_node("Relu", ["k"], ["c1"], name="free")]  # free: constants only
    for i in range(int(rng.integers(3, 10))):
        op = str(rng.choice(["MatMul", "Add", "Relu", "Mul"]))
        pool = flow + ["x1"] * (i >= 2)  # x1 read late if at all
        a = str(rng.choice(pool))
        other = {"MatMul": weights, "Add": pool, "Mul": ["c0", "c1"], "Relu": []}[op]
        inputs = [a, str(rng.choice(other))] if other else [a]
        nodes.append(helper.make_node(op, inputs, [f"t{i}"], name=f"n{i}"))
        flow.append(f"t{i}")

    def value(name: str, shape: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)

    made = flow[1:]
    outputs = [value(made[-1], [2, 4])] + [value(t, [2, 4]) for t in made[:-1]
                                            if rng.random() < 0.2]
    initializers = [floats([4, 4], w) for w in weights] + [floats([4], "k")]
    tail = rng.random()
    if tail < 0.2:  # an initializer no operator reads, as an output
        initializers.append(floats([3, 4], "whole"))
        outputs.append(value("whole", [3, 4]))
    elif tail < 0.4:  # a weight operators read, as an output too
        outputs.append(value(weights[0], [4, 4]))
    elif tail < 0.6:  # a constant computed from an initializer, as an output
        outputs.append(value("c1", [4]))
    graph = helper.make_graph(
        nodes, "relay", [value("x0", [2, 4]), value("x1", [2, 4]), value("unused", [2, 4])],
        outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
