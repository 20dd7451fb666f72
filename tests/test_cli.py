"""The command line: bad input gets one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import helper, numpy_helper
from support.graphs import CHAIN, save

from onnx_partition.cli import main


def fails(capsys, argv, pattern):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert pattern in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def chain(tmp_path):
    return save(CHAIN, tmp_path / "m.onnx")


def test_missing_file(capsys, tmp_path):
    fails(capsys, ["partition", tmp_path / "nope.onnx", "-s", "2", "-o", tmp_path / "o"],
          "no such file")


def test_not_onnx(capsys, tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n" * 10)
    fails(capsys, ["partition", bad, "-s", "2", "-o", tmp_path / "o"], "not a valid ONNX model")


def test_empty_file(capsys, tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    fails(capsys, ["partition", tmp_path / "empty.onnx", "-s", "2", "-o", tmp_path / "o"],
          "not a valid ONNX model")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_truncated_file(capsys, tmp_path, chain, keep):
    data = chain.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: int(len(data) * keep)])
    fails(capsys, ["partition", cut, "-s", "2", "--batch-size", "2", "-o", tmp_path / "o"],
          f"{cut} is not a valid ONNX model (truncated or not ONNX)")
    assert not (tmp_path / "o").exists()


def test_missing_external_data(capsys, tmp_path):
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64])], initializer=[w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
                    location="m.onnx.data", size_threshold=0)
    (tmp_path / "m.onnx.data").unlink()
    fails(capsys, ["partition", tmp_path / "m.onnx", "-s", "2", "-o", tmp_path / "o"],
          "missing external data file 'm.onnx.data'")


def test_cycle(capsys, tmp_path):
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Add", ["x", "c"], ["a"], name="n1"),
             helper.make_node("Relu", ["a"], ["b"], name="n2"),
             helper.make_node("Neg", ["b"], ["c"], name="n3"),
             helper.make_node("Identity", ["b"], ["y"], name="n4")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "cyc.onnx"))
    line = fails(capsys, ["partition", tmp_path / "cyc.onnx", "-s", "2", "-o", tmp_path / "o"],
                 "cycle")
    assert "n1" in line and "n3" in line


def test_too_many_stages(capsys, tmp_path, chain):
    fails(capsys, ["partition", chain, "-s", "7", "--batch-size", "2", "-o", tmp_path / "o"],
          "the model has 6 operators")


def test_unknown_input_name(capsys, tmp_path, chain):
    fails(capsys, ["partition", chain, "-s", "2", "--input-shape", "z=2,4", "-o", tmp_path / "o"],
          "unknown input 'z'; the model's inputs are: x")


def test_malformed_input_shape(capsys, tmp_path, chain):
    fails(capsys, ["partition", chain, "-s", "2", "--input-shape", "x=two", "-o", tmp_path / "o"],
          "expected NAME=D0,D1")


def test_symbolic_dim_left_unknown(capsys, tmp_path, chain):
    fails(capsys, ["partition", chain, "-s", "2", "-o", tmp_path / "o"], "is symbolic")


def test_user_folder_is_never_overwritten(capsys, tmp_path, chain):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    fails(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "-o", out],
          "not an earlier plan; use --force")
    assert (out / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "mine"]  # no temp left
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o", str(out),
                 "--force"]) == 0
    assert not (out / "thesis.tex").exists()


def test_earlier_plan_is_replaced(capsys, tmp_path, chain):
    out = tmp_path / "plan"
    argv = ["partition", str(chain), "--batch-size", "2", "-o", str(out)]
    assert main([*argv, "-s", "3"]) == 0
    assert main([*argv, "-s", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "stage_0.onnx", "stage_1.onnx"]
    assert len(json.loads((out / "plan.json").read_text())["stages"]) == 2
    out_text = capsys.readouterr().out
    assert "bottleneck" in out_text and "wrote 2 stages" in out_text


def test_costs_file_errors(capsys, tmp_path, chain):
    (tmp_path / "c.json").write_text(json.dumps({"nodes": {"zzz": {"forward_ms": 1}}}))
    fails(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "--costs",
                   tmp_path / "c.json", "-o", tmp_path / "o"], "names none of the model's nodes")
    (tmp_path / "c.json").write_text("{")
    fails(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "--costs",
                   tmp_path / "c.json", "-o", tmp_path / "o"], "cannot read costs file")


def test_run_checks_plan_folder(capsys, tmp_path, chain):
    out = tmp_path / "plan"
    assert main(["partition", str(chain), "-s", "3", "--batch-size", "2", "-o", str(out)]) == 0
    assert main(["run", str(out), "--check", "--iterations", "2"]) == 0
    assert "max relative error" in capsys.readouterr().out
    stage = out / "stage_1.onnx"
    data = bytearray(stage.read_bytes())
    data[-1] ^= 1
    stage.write_bytes(bytes(data))
    fails(capsys, ["run", out], "stage_1.onnx does not match its sha256")
    stage.write_bytes(bytes(data) + b"\0")
    fails(capsys, ["run", out],
          f"stage_1.onnx has {len(data) + 1} bytes, its manifest says {len(data)}")
    stage.unlink()
    fails(capsys, ["run", out], "stage_1.onnx is missing")
    fails(capsys, ["run", tmp_path], "is not a plan folder")
    plan = json.loads((out / "plan.json").read_text())
    plan["stages"][1]["file"] = "../m.onnx"
    (out / "plan.json").write_text(json.dumps(plan))
    fails(capsys, ["run", out], "must be a path inside the plan folder")


def test_simulate_and_report_interleaved(capsys, tmp_path, chain):
    out = tmp_path / "plan"
    assert main(["partition", str(chain), "-s", "4", "--batch-size", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out), "--schedule", "interleaved"]) == 0  # --chunks 2
    text = capsys.readouterr().out
    assert "interleaved what-if: 4 stages on 2 devices per replica, 2 model chunks" in text
    assert "device 1 replica 0 (stages 1, 3)" in text and "3B7" in text
    assert main(["simulate", str(out), "--schedule", "interleaved", "--chunks", "4",
                 "--microbatches", "3"]) == 0
    assert "device 0 replica 0 (stages 0, 1, 2, 3)" in capsys.readouterr().out
    html = tmp_path / "r.html"
    assert main(["report", str(out), "-o", str(html), "--schedule", "interleaved",
                 "--chunks", "2", "--microbatches", "4"]) == 0
    assert "device 0 · replica 0 · stages 0, 2" in html.read_text()
    fails(capsys, ["simulate", out, "--schedule", "interleaved", "--chunks", "3"],
          "the chunk count must divide the stage count")
    fails(capsys, ["simulate", out, "--schedule", "interleaved", "--microbatches", "5"],
          "micro-batches in multiples of 2 devices = 2, got 5")
    fails(capsys, ["simulate", out, "--chunks", "2"], "--chunks needs --schedule interleaved")
    fails(capsys, ["report", out, "--schedule", "1f1b", "--chunks", "2"],
          "--chunks needs --schedule interleaved")
    fails(capsys, ["report", out, "--schedule", "interleaved", "--chunks", "0"],
          "--chunks must be an integer from 1 to 4096")
    body = json.loads((out / "plan.json").read_text())
    body["stages"][2]["replicas"] = 2
    (out / "plan.json").write_text(json.dumps(body))
    fails(capsys, ["simulate", out, "--schedule", "interleaved"],
          "same replica count in every stage, got [1, 1, 2, 1]")
    assert not (out / "report.html").exists()  # the failed reports wrote nothing


def test_console_script_exit_code_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "onnx_partition.cli", "partition", str(tmp_path / "x.onnx"),
         "-s", "2", "-o", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: no such file: {tmp_path / 'x.onnx'}"]


def test_link_options_shape_the_shorthand_cluster(capsys, chain, tmp_path):
    """--bandwidth/--latency are the link inside a machine, --inter-* the one between; a
    near-dead network between two machines keeps the plan on the first."""
    argv = ["partition", chain, "-o", tmp_path / "out", "--batch-size", "2", "--devices", "2",
            "--machines", "2", "--mode", "train", "--no-program", "--bandwidth", "100",
            "--latency", "0",
            "--inter-bandwidth", "0.000001", "--inter-latency", "1"]
    assert main([str(a) for a in argv]) == 0
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    cluster = plan["cluster"]
    assert cluster["intra"] == {"bandwidth_gbps": 100.0, "latency_ms": 0.0}
    assert cluster["inter"] == {"bandwidth_gbps": 0.000001, "latency_ms": 1.0}
    assert all(d.startswith("m0/") for s in plan["stages"] for d in s["devices"])
    capsys.readouterr()
    fails(capsys, ["partition", chain, "-o", tmp_path / "o2", "-s", "2",
                   "--inter-bandwidth", "5"], "need --devices N or --cluster")
    fails(capsys, ["partition", chain, "-o", tmp_path / "o3", "-s", "2", "--machines", "2"],
          "--machines 2 needs --devices N (devices per machine")  # not silently one machine
    fails(capsys, [*argv[:10], "--inter-latency", "-1"], "--inter-latency must be a finite number")


def test_one_line_takes_the_first_line_and_never_fails_on_an_empty_message():
    from onnx_partition.errors import one_line

    assert one_line(ValueError("first\nsecond")) == "first"
    assert one_line(ValueError("")) == "ValueError('')"
    assert one_line(RuntimeError("[enforce fail at op.cc:12] bad shape")) == "bad shape"
    try:  # torch pipelining's wrapper: an empty first line after the colon, the cause chained
        try:
            raise RuntimeError("Can't detach views in-place. Use detach() instead.")
        except RuntimeError as exc:
            raise RuntimeError("\n   Failed to run stage backward input:\n   Stage output: ...") \
                from exc
    except RuntimeError as wrapped:
        assert one_line(wrapped) == ("Failed to run stage backward input: Can't detach views "
                                     "in-place. Use detach() instead.")


# -------------------------------------------------------------------- errors that say what to do


@pytest.mark.parametrize(("argv", "said"), [
    (["partition", "m.onnx", "--num-stages", "3", "-o", "p"], "did you mean --stages?"),
    (["partition", "m.onnx", "--batchsize", "3", "-o", "p"], "did you mean --batch-size?"),
    (["partition", "m.onnx", "--stages=3", "--micro-batches=4", "-o", "p"],
     "unknown option --micro-batches; did you mean --microbatches?"),
    (["run", "plan", "--iteratons", "3"], "did you mean --iterations?"),
    (["simulate", "plan", "--shedule", "gpipe"], "did you mean --schedule?"),
    (["partition", "m.onnx", "--mode", "training", "-o", "p"],
     "--mode 'training' is not one of infer, train; did you mean train?"),
    (["partition", "m.onnx", "--order", "bfs", "-o", "p"],
     "--order 'bfs' is not one of auto, topo, dfs, minlive, cluster"),
    (["partiton", "m.onnx"], "'partiton' is not one of export, profile, partition"),
    (["partition", "m.onnx"], "required: -o/--output"),
])
def test_argument_errors_are_one_line_with_the_nearest(capsys, argv, said):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""  # nothing printed before (or beside) the error
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    assert "usage:" not in captured.err


def test_training_an_inference_plan_says_partition_with_mode_train(capsys, tmp_path, chain):
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o",
                 str(tmp_path / "p"), "-q"]) == 0
    capsys.readouterr()
    line = fails(capsys, ["train", tmp_path / "p"], "is an inference plan (--mode infer)")
    assert "partition the model again with --mode train" in line


def test_train_mode_needs_the_program_unless_a_plan_only_is_asked(capsys, tmp_path, chain):
    out = tmp_path / "p"
    line = fails(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "--mode", "train",
                          "-o", out], "has no exported program m.pt2 beside it")
    assert "--no-program" in line and "onnx-partition export" in line
    assert not out.exists()  # said at once, nothing written
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "--mode", "train",
                 "--no-program", "-o", str(out), "-q"]) == 0
    assert json.loads((out / "plan.json").read_text())["mode"] == "train"


def test_gpu_implies_cuda(capsys, tmp_path, chain):
    out = tmp_path / "p"
    assert main(["partition", str(chain), "--devices", "2", "--batch-size", "2",
                 "--gpu", "a100-80gb", "-o", str(out), "-q"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cluster"]["kind"] == "cuda" and plan["cluster"]["gpu"] == "a100-80gb"
    assert all(d.startswith("cuda:") for s in plan["stages"] for d in s["devices"])
    fails(capsys, ["partition", chain, "--devices", "2", "--batch-size", "2", "--gpu", "h100",
                   "--device-kind", "cpu", "-o", tmp_path / "q"],
          "cannot go with --device-kind cpu")


def test_a_wrong_process_count_is_said_before_anything_is_printed(capsys, tmp_path, chain):
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o",
                 str(tmp_path / "p"), "-q"]) == 0
    capsys.readouterr()
    assert main(["run", str(tmp_path / "p"), "--nproc", "5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "error: the plan has 2 stage replicas (1 + 1); got 5 processes"]


# ------------------------------------------------------------------------ help that is true


def _help(capsys, verb: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("verb", ["export", "profile", "partition", "run", "train", "simulate",
                                  "report", "demo"])
def test_every_verb_says_what_it_reads_and_writes(capsys, verb):
    text = _help(capsys, verb)
    assert re.search(r"\b(Read|Build|Export)", text) and re.search(r"\b[Ww]rites?\b", text)
    # one default per option, shown once
    for item in re.split(r"\s(?=-{1,2}[a-z])", text):
        assert len(re.findall(r"\bdefault\b", item)) <= 1, item


def test_help_groups_options_by_what_they_apply_to(capsys):
    text = _help(capsys, "partition")
    every = text.index("every plan (--stages and cluster plans alike)")
    plain = text.index("plain pipelines (--stages without a cluster)")
    cluster = text.index("cluster plans (stages x data-parallel replicas)")
    for option in ("--mode", "--microbatches", "--gpu", "--device-kind"):
        assert every < text.index(f"{option} ", every) < plain, option
    assert plain < text.index("--order ", plain) < cluster
    assert "implies --device-kind cuda" in text and "--no-program" in text
    assert "(default gpt) (default: gpt)" not in _help(capsys, "demo")


def test_train_help_says_where_data_and_loss_come_from(capsys):
    text = _help(capsys, "train")
    assert "synthetic batches" in text and "synthetic loss" in text
    assert "cross-entropy" in text and "mean squared error" in text
    assert "default: one per stage replica" in text


def test_json_keeps_stdout_for_the_one_object(capsys, tmp_path, chain):
    """--json: progress and status lines (here the --device-memory reading) go to stderr, so
    stdout parses as one JSON object; without --json they stay on stdout."""
    argv = ["partition", chain, "--devices", "2", "--device-memory", "1GB", "--batch-size", "4",
            "-o", tmp_path / "plan"]
    assert main([str(a) for a in [*argv, "--json"]]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stages"] and "device memory '1GB' read as" in err
    assert main([str(a) for a in [*argv, "--force"]]) == 0
    assert "device memory '1GB' read as" in capsys.readouterr().out
