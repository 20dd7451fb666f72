"""``run`` runs the plan as planned, and predicted vs measured in ``--json`` and the report.

Real onnxruntime sessions (threads) and real gloo processes (``--nproc``); no timing asserts.
"""

from __future__ import annotations

import json

import pytest
from support.graphs import CHAIN, SKIP, save

from onnx_partition.cli import main
from onnx_partition.cli.summary.run import idle_replicas_note
from onnx_partition.pipeline.predict import RunShape
from onnx_partition.plan import read_plan
from onnx_partition.values import sig3


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A 2-stage plan on 3 CPU devices: one stage gets 2 replicas (planner's choice)."""
    tmp = tmp_path_factory.mktemp("hybrid")
    model = save(SKIP, tmp / "m.onnx")
    out = tmp / "plan"
    assert main(["partition", str(model), "-s", "2", "--devices", "3", "--batch-size", "3",
                 "--microbatches", "6", "--bandwidth", "100", "--latency", "0",
                 "-o", str(out)]) == 0
    plan = read_plan(out)
    assert sorted(s.replicas for s in plan.stages) == [1, 2]
    return out


def run_json(capsys, argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err  # stdout is one JSON object, nothing else


@pytest.mark.parametrize("nproc", [None, 3], ids=["threads", "gloo"])
def test_run_feeds_every_replica_at_the_plans_shape(hybrid, capsys, nproc):
    extra = ["--nproc", str(nproc)] if nproc else []
    body, err = run_json(capsys, ["run", hybrid, "--json", "--iterations", "2", "--warmup", "1",
                                  "--check", *extra])
    plan = json.loads((hybrid / "plan.json").read_text())
    assert body["microbatches"] == plan["predicted"]["microbatches"] == 6
    assert body["batch_size"] == plan["batch_size"] == 3 and body["rows"] == 18
    assert "6 micro-batches x 3 rows = 18 rows per iteration" in err
    assert body["check"] == "ok"
    devices = {(d["stage"], d["replica"]): d["busy_ms"] for d in body["measured"]["devices"]}
    expected = {(s["index"], r) for s in plan["stages"] for r in range(s["replicas"])}
    assert set(devices) == expected and all(ms > 0 for ms in devices.values())
    cpu = {(d["stage"], d["replica"]): d["cpu_ms"] for d in body["measured"]["devices"]}
    assert set(cpu) == expected and all(ms > 0 for ms in cpu.values())
    measured, predicted = body["measured"], body["predicted"]
    for part in (measured, predicted):
        assert part["microbatches"] == 6 and part["batch_size"] == 3
        assert part["samples_per_s"] == pytest.approx(18 / part["iteration_ms"] * 1000, rel=1e-3)
    assert body["ratio"]["samples_per_s"] == pytest.approx(
        measured["samples_per_s"] / predicted["samples_per_s"], rel=1e-3)
    assert len(body["ratio"]["stage_busy_ms"]) == 2
    assert body["runtime"] == ("threads" if nproc is None else "distributed:gloo")
    if nproc is not None:  # each rank's measured memory (runtime.infer.resident)
        ranks = measured["devices"]
        assert all(0 < d["memory_bytes"] <= d["resident_bytes"] for d in ranks), ranks
        for stage in measured["stages"]:
            mine = [d for d in ranks if d["stage"] == stage["index"]]
            assert stage["memory_bytes"] == max(d["memory_bytes"] for d in mine)
            assert stage["resident_bytes"] == max(d["resident_bytes"] for d in mine)
        assert "VmHWM" in measured["memory_source"]


def test_run_text_prints_measured_against_predicted(hybrid, capsys):
    assert main(["run", str(hybrid), "--iterations", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "6 micro-batches x 3 rows = 18 rows per iteration (plan: 6 micro-batches x 3 rows)" \
        in out
    for row in ("samples/s", "iteration ms", "stage 0 busy ms", "stage 1 busy ms"):
        assert row in out
    assert "measured/predicted" in out


def test_fewer_microbatches_than_replicas_is_said(hybrid, capsys):
    assert main(["run", str(hybrid), "--microbatches", "1", "--iterations", "1",
                 "--warmup", "0"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 micro-batches for up to 2 replicas" in err[0]
    assert idle_replicas_note(read_plan(hybrid), 2) is None


def test_batch_size_means_rows_per_microbatch_everywhere(hybrid, capsys):
    body, _ = run_json(capsys, ["run", hybrid, "--json", "--batch-size", "5",
                                "--microbatches", "2", "--iterations", "1", "--warmup", "0"])
    assert (body["batch_size"], body["microbatches"], body["rows"]) == (5, 2, 10)
    # predicted at 5 rows from a plan simulated at 3: scaled linearly
    assert body["predicted"]["scaled_from_batch_size"] == 3
    assert read_plan(hybrid).rows_per_microbatch == 3 and RunShape(5, 2).rows == 10


def test_simulate_and_partition_json(hybrid, capsys, tmp_path):
    sim, _ = run_json(capsys, ["simulate", hybrid, "--json"])
    plan = json.loads((hybrid / "plan.json").read_text())
    assert sim["microbatches"] == 6 and sim["batch_size"] == 3 and sim["schedule"] == "infer"
    assert sim["iteration_ms"] == pytest.approx(plan["predicted"]["iteration_ms"], rel=1e-6)
    assert {"compute_ms", "memory_bytes", "busy_ms", "replicas"} <= set(sim["stages"][0])
    doubled, _ = run_json(capsys, ["simulate", hybrid, "--json", "--batch-size", "6"])
    assert doubled["iteration_ms"] == pytest.approx(2 * sim["iteration_ms"], rel=1e-5)
    assert doubled["samples_per_s"] == pytest.approx(sim["samples_per_s"], rel=1e-5)
    assert doubled["scaled_from_batch_size"] == 3 and doubled["rows"] == 36
    part, _ = run_json(capsys, ["partition", save(CHAIN, tmp_path / "m.onnx"), "-s", "2",
                                "--batch-size", "2", "-o", tmp_path / "p", "--json"])
    assert part["batch_size"] == 2 and part["microbatches"] == 8
    assert part["plan_dir"] == str(tmp_path / "p") and len(part["stages"]) == 2
    assert {"compute_ms", "comm_ms", "memory_bytes"} == set(part["stages"][0]["predicted"])
    assert "throughput_per_s" in part["predicted"]


def test_report_shows_the_measured_run(hybrid, capsys, tmp_path):
    body, _ = run_json(capsys, ["run", hybrid, "--json", "--iterations", "1", "--warmup", "0"])
    (tmp_path / "run.json").write_text(json.dumps(body))
    out = tmp_path / "r.html"
    assert main(["report", str(hybrid), "--measured", str(tmp_path / "run.json"),
                 "-o", str(out)]) == 0
    page = out.read_text()
    assert "Measured run against the simulation" in page
    assert sig3(body["measured"]["iteration_ms"]) in page  # the report's number format
    assert sig3(body["predicted"]["iteration_ms"]) in page
    (tmp_path / "other.json").write_text(json.dumps({**body, "replicas": [1, 1, 1]}))
    assert main(["report", str(hybrid), "--measured", str(tmp_path / "other.json"),
                 "-o", str(out)]) == 2
    assert "another plan" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["report", str(hybrid), "--measured", str(tmp_path / "bad.json"),
                 "-o", str(out)]) == 2


def test_a_model_with_a_fixed_batch_runs_in_micro_batches_of_it(tmp_path, capsys):
    fixed = CHAIN.replace("float[N, 4] x", "float[3, 4] x").replace("float[N, 4] y",
                                                                    "float[3, 4] y")
    model = save(fixed, tmp_path / "m.onnx")
    assert main(["partition", str(model), "-s", "2", "-o", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    body, _ = run_json(capsys, ["run", tmp_path / "p", "--json", "--check", "--microbatches",
                                  "2", "--iterations", "1", "--warmup", "0"])
    assert (body["batch_size"], body["rows"], body["check"]) == (3, 6, "ok")
