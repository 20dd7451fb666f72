"""Small ONNX models the tests partition and run, written from text or built by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
from onnx import helper, numpy_helper

__all__ = ["CHAIN", "SKIP", "feeds_for", "gather_model", "save"]

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
