"""Valid models that were refused or broke at run time: each partitions at every stage count
and runs to the whole model's outputs (or ends in one line and exit code 2)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import helper, numpy_helper

from onnx_partition.cli import main
from onnx_partition.partition import partition

LOOP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y, float[3, N, 4] scan)
{
  a = Relu(x)
  trip = Constant<value = int64 {3}>()
  cond = Constant<value = bool {1}>()
  acc_out, scan = Loop(trip, cond, a) <body = body (int64 i, bool c, float[N,4] acc)
      => (bool c_out, float[N,4] acc2, float[N,4] sc) {
    c_out = Identity(c)
    acc2 = Add(acc, acc)
    sc = Identity(acc2)
  }>
  b = Tanh(acc_out)
  y = Add(b, a)
}
"""

INITIALIZER_OUTPUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y, float[4,4] w)
  <float[4,4] w = {1.0,2,0,0, 0,1,0,0, 0,0,1,0, 0,0,3,1}>
{
  a = MatMul(x, w)
  b = Relu(a)
  y = Tanh(b)
}
"""

UNBATCHED_INPUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x, float[4] s) => (float[N, 4] y)
{
  a = Relu(x)
  b = Mul(a, s)
  y = Tanh(b)
}
"""

DUPLICATE_NAMES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 4] y)
{
  a = Relu(x)
  b = Tanh(a)
  y = Relu(b)
}
"""


def model(tmp_path, text: str, *, same_names: bool = False):
    proto = onnx.parser.parse_model(text)
    if same_names:
        for node in proto.graph.node:
            node.name = "same"
    onnx.checker.check_model(proto, full_check=True)  # valid models, every one
    path = tmp_path / "m.onnx"
    onnx.save(proto, str(path))
    return path


@pytest.mark.parametrize(("text", "same_names"), [
    (LOOP, False), (INITIALIZER_OUTPUT, False), (UNBATCHED_INPUT, False),
    (DUPLICATE_NAMES, True)], ids=["loop", "initializer-output", "unbatched-input",
                                   "duplicate-names"])
def test_valid_models_partition_and_run_at_every_stage_count(capsys, tmp_path, text,
                                                             same_names):
    path = model(tmp_path, text, same_names=same_names)
    for stages in (1, 2, 3):
        out = tmp_path / f"plan{stages}"
        assert main(["partition", str(path), "-s", str(stages), "--batch-size", "2", "-o",
                     str(out)]) == 0, capsys.readouterr().err
        for batch in ("2", "5"):
            code = main(["run", str(out), "--check", "--iterations", "1", "--microbatches", "2",
                         "--batch-size", batch])
            assert code == 0, capsys.readouterr()
            assert "(OK)" in capsys.readouterr().out


def test_a_huge_external_tensor_is_copied_in_blocks(tmp_path):
    """A 16 MiB weight costs the partitioner no 16 MiB of memory (was: read whole)."""
    weight = numpy_helper.from_array(np.ones((2048, 2048), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, ["N", 2048])],
                              [helper.make_tensor_value_info("y", 1, ["N", 2048])], [weight])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data")
    del proto, graph, weight
    tracemalloc.start()
    try:
        partition(tmp_path / "m.onnx", 1, tmp_path / "out", batch_size=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (tmp_path / "out" / "stage_0.onnx.data").stat().st_size == 2048 * 2048 * 4
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB"
