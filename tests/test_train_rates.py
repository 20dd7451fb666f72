"""A train plan's tokens/s, tokens/s per GPU and MFU (issue 34 item 4): the one function
(:func:`onnx_partition.mfu.train_rates`), the parameter count it is given, and what
``partition`` prints of them (the summary and ``--json``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.graphs import CHAIN, save

from onnx_partition.cli.verbs import main
from onnx_partition.graph.weightless import weightless_tensor
from onnx_partition.mfu import TrainRates, model_parameters, train_rates

H100_BF16 = 989.4e12


def test_train_rates_exactly():
    """100 tokens in 250 ms on 4 GPUs: 400 tokens/s, 100 per GPU; 10 parameters at 1e5 FLOP/s
    per GPU: 6 x 10 x 400 / (4 x 1e5) = 0.06."""
    assert train_rates(10, 100, 250.0, 4, 1e5) == TrainRates(400.0, 100.0, 0.06)
    assert train_rates(10, 100, 250.0, 4, None) == TrainRates(400.0, 100.0, None)
    for step, gpus in ((0.0, 4), (float("inf"), 4), (250.0, 0)):
        with pytest.raises(ValueError):
            train_rates(10, 100, step, gpus, 1e5)


def _token_model(path: Path, *, weightless: bool = False) -> Path:
    """ids (N x 8 token ids) -> a 16 x 4 embedding -> MatMul 4 x 4 -> Relu -> mean: 80
    parameters, and an int64 initializer (the axes) that is not one."""
    table = (weightless_tensor("table", (16, 4), TensorProto.FLOAT) if weightless else
             numpy_helper.from_array(np.ones((16, 4), np.float32), "table"))
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    axes = numpy_helper.from_array(np.array([1, 2], np.int64), "axes")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"], name="gather"),
             helper.make_node("MatMul", ["g", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r", "axes"], ["y"], name="mean", keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        initializer=[table, w, axes])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_model_parameters_counts_floating_point_initializers_without_their_data(tmp_path):
    assert model_parameters(_token_model(tmp_path / "m.onnx")) == 16 * 4 + 4 * 4
    assert model_parameters(_token_model(tmp_path / "w.onnx", weightless=True)) == 80
    # weights held outside the file: counted from the shapes, the data never read
    model = onnx.load(str(tmp_path / "m.onnx"))
    onnx.save(model, str(tmp_path / "x.onnx"), save_as_external_data=True,
              location="x.onnx.data", size_threshold=0)
    (tmp_path / "x.onnx.data").unlink()
    assert model_parameters(tmp_path / "x.onnx") == 80


_TRAIN = ["--mode", "train", "--no-program", "--devices", "2", "--gpu", "h100",
          "--batch-size", "3", "--microbatches", "4", "--force"]


def test_the_partition_summary_gives_tokens_per_s_per_gpu_and_mfu(tmp_path, capsys):
    """4 micro-batches x 3 rows x 8 tokens per iteration; the figures from plan.json by hand."""
    model, out = _token_model(tmp_path / "tok.onnx"), tmp_path / "plan"
    assert main(["partition", str(model), *_TRAIN, "-o", str(out)]) == 0
    said = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    step_s = plan["predicted"]["iteration_ms"] / 1000
    gpus = sum(s["replicas"] for s in plan["stages"])
    rate = 96 / step_s
    mfu = 6 * 80 * rate / (gpus * H100_BF16)
    line = next(t for t in said.splitlines() if t.startswith("tokens:"))
    assert line == (f"tokens: 96 per iteration (4 micro-batches x 3 rows x 8), {rate:,.0f} "
                    f"tokens/s, {rate / gpus:,.0f} per GPU ({gpus} GPU{'s' * (gpus > 1)}); "
                    f"MFU {mfu * 100:.3g}% (6 x 80 parameters x tokens / (iteration x GPUs x "
                    f"989.4 TFLOP/s bf16 peak))")

    assert main(["partition", str(model), *_TRAIN, "-o", str(out), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    plan = json.loads((out / "plan.json").read_text())
    rate = 96 / (plan["predicted"]["iteration_ms"] / 1000)
    assert body["parameters"] == 80 and body["tokens_per_step"] == 96
    assert body["gpus"] == gpus and body["peak_tflops"] == 989.4
    assert body["tokens_per_s"] == pytest.approx(rate, rel=1e-12)
    assert body["tokens_per_s_per_gpu"] == pytest.approx(rate / gpus, rel=1e-12)
    assert body["mfu"] == pytest.approx(6 * 80 * rate / (gpus * H100_BF16), rel=1e-12)


def test_no_tokens_line_without_token_ids_or_training_and_no_mfu_without_a_peak(tmp_path,
                                                                                  capsys):
    chain = save(CHAIN, tmp_path / "chain.onnx")
    assert main(["partition", str(chain), *_TRAIN, "-o", str(tmp_path / "a")]) == 0
    assert "tokens:" not in capsys.readouterr().out  # float inputs: no tokens
    model = _token_model(tmp_path / "tok.onnx")
    assert main(["partition", str(model), "-s", "2", "--batch-size", "3",
                 "-o", str(tmp_path / "b")]) == 0
    assert "tokens:" not in capsys.readouterr().out  # inference
    assert main(["partition", str(model), "--mode", "train", "--no-program", "-s", "2",
                 "--batch-size", "3", "--cpu-tflops", "1", "-o", str(tmp_path / "c")]) == 0
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("tokens:"))
    assert line.endswith("per CPU (2 CPUs); MFU not known (no GPU peak)")  # not "per GPU"
