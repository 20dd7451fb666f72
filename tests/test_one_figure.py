"""One figure everywhere (issue 20, item 5): ``partition``, ``simulate``, ``report`` and ``run``
state the same value for the same predicted quantity of one plan; the analytic CPU speed is
measured once and cached (or pinned), so the same command gives the same plan; a named GPU
brings its datasheet memory and link, and the summary says where each came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import one_error

from onnx_partition.cli import main
from onnx_partition.cost.devices import CPU_SPEED_FILE, cache_home, measured_cpu
from onnx_partition.pipeline.predict import SHARED, SHARED_STAGE
from onnx_partition.plan import read_plan
from onnx_partition.report.page import report_figures

PIN = ["--cpu-tflops", "0.05", "--cpu-gbps", "8"]  # the same plan on any machine


def _partition(model: Path, *options: object) -> list[object]:
    return ["partition", model, "--batch-size", "2", *options]


def _json(capsys: pytest.CaptureFixture[str], argv: list) -> dict:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def _text(capsys: pytest.CaptureFixture[str], argv: list) -> str:
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def _shared(body: dict) -> tuple[dict, list[dict]]:
    return ({k: body[k] for k in SHARED},
            [{k: s[k] for k in SHARED_STAGE} for s in body["stages"]])


@pytest.mark.parametrize("options", [
    ["--stages", "2"],
    ["--stages", "2", "--mode", "train"],
    ["--devices", "4", "--stages", "2"],
], ids=["infer", "train", "hybrid"])
def test_one_plan_one_figure(exported, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             options: list[str]) -> None:
    model, plan_dir = exported("gpt"), tmp_path / "plan"
    base = _partition(model, "--microbatches", "4", *PIN, *options, "-o", plan_dir)
    part = _json(capsys, [*base, "--json"])
    plan = read_plan(plan_dir)
    sim = _json(capsys, ["simulate", plan_dir, "--json"])
    assert main(["report", str(plan_dir), "-o", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()
    page = report_figures((tmp_path / "r.html").read_text())
    # partition --json, simulate --json and the report state the same figures, exactly
    assert _shared(part) == _shared(sim) == _shared(page)
    assert part["schedule"] == plan.extra["schedule"] == sim["schedule"]
    assert part["schedule"] in (("1f1b", "zb-h1") if plan.mode == "train" else ("infer",))
    # ... which are plan.json's: the iteration it was priced by, its memory per stage
    for key in ("iteration_ms", "throughput_per_s", "bubble_fraction", "microbatches"):
        assert plan.predicted[key] == part[key], key
    assert part["predicted"] == plan.predicted
    for stage, figures in zip(plan.stages, part["stages"]):
        assert stage.predicted is not None
        assert figures["memory_bytes"] == stage.predicted.memory_bytes
        assert figures["compute_ms"] == stage.predicted.compute_ms
    if plan.mode == "train":  # priced on forward + backward, as it trains
        assert all(s.predicted and s.predicted.compute_ms == pytest.approx(
            s.predicted.forward_ms + s.predicted.backward_ms, abs=2e-6) for s in plan.stages)
        # busy: 4 micro-batches' compute, and 3 gradient accumulations (the first sets them);
        # under ZB-H1, 4 times the split backward's overhead; the engine's work on each of the
        # 8 actions (12 under ZB-H1: F, I and W per micro-batch)
        split = plan.simulator_costs.get("split_ms", [0.0, 0.0])
        zb = plan.extra["schedule"] == "zb-h1"
        assert (split[-1] > 0) == zb and split[0] == 0.0
        actions = 12 if zb else 8
        for k in (0, len(plan.stages) - 1):
            assert sim["stages"][k]["busy_ms"] == pytest.approx(
                4 * plan.stages[k].predicted.compute_ms
                + 3 * plan.simulator_costs["accumulate_ms"][k] + 4 * split[k]
                + actions * plan.simulator_costs["action_ms"][k], rel=1e-5)
        # train prices the step it runs by the same simulation (the plan's defaults)
        trained = _json(capsys, ["train", plan_dir, "--steps", "1", "--json"])
        assert trained["predicted"]["iteration_ms"] == plan.predicted["iteration_ms"]
    # the text outputs print the same iteration
    text = _text(capsys, [*base, "--force"])
    assert f"iteration of {plan.predicted['iteration_ms']:.3f} ms (simulated" in text
    assert f": {plan.predicted['iteration_ms']:.3f} ms, " in _text(capsys, ["simulate", plan_dir])
    assert read_plan(plan_dir).predicted == plan.predicted  # the same command, the same plan


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_run_predicts_what_simulate_says(exported, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str], mode: str) -> None:
    """A real onnxruntime run: its ``predicted`` is the plan's forward simulation, figure for
    figure ``simulate --schedule infer``'s; a train plan's forward pass is priced by its
    forward times alone."""
    plan_dir = tmp_path / "plan"
    assert main(["-q", "partition", str(exported("gpt")), "--stages", "2", "--batch-size", "2",
                 "--microbatches", "3", "--mode", mode, *PIN, "-o", str(plan_dir)]) == 0
    capsys.readouterr()
    assert main([str(a) for a in ["run", plan_dir, "--json", "--iterations", "1",
                                  "--warmup", "0"]]) == 0
    printed = capsys.readouterr()
    run = json.loads(printed.out)
    # a train plan's forward is priced as torch trains it; run says its ratio spans executors
    assert ("measured/predicted compares two executors" in printed.err) == (mode == "train")
    sim = _json(capsys, ["simulate", plan_dir, "--json", "--schedule", "infer"])
    assert _shared(run["predicted"]) == _shared(sim)
    plan = read_plan(plan_dir)
    for stage, figures in zip(plan.stages, run["predicted"]["stages"]):
        assert stage.predicted is not None
        forward = stage.predicted.forward_ms if mode == "train" else stage.predicted.compute_ms
        assert figures["compute_ms"] == forward
        assert figures["busy_ms"] == pytest.approx(3 * forward, rel=1e-5)
    if mode == "infer":
        assert run["predicted"]["iteration_ms"] == plan.predicted["iteration_ms"]


def test_cpu_speed_measured_once_and_cached(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    assert cache_home() == tmp_path / "a" / "onnx-partition"
    first = measured_cpu()
    assert first is measured_cpu() and "measured now, cached in" in first.source
    body = json.loads((cache_home() / CPU_SPEED_FILE).read_text())
    (entry,) = body["machines"].values()
    assert (entry["peak_gflops"], entry["mem_gbps"], entry["launch_overhead_ms"]) == (
        first.peak_gflops, first.mem_gbps, first.launch_overhead_ms)
    # another machine's cache: its figures are read, not measured
    for item in body["machines"].values():
        item.update(peak_gflops=123.0, mem_gbps=4.5, launch_overhead_ms=0.25)
    (tmp_path / "b" / "onnx-partition").mkdir(parents=True)
    (tmp_path / "b" / "onnx-partition" / CPU_SPEED_FILE).write_text(json.dumps(body))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    read = measured_cpu()
    assert (read.peak_gflops, read.mem_gbps, read.launch_overhead_ms) == (123.0, 4.5, 0.25)
    assert read.source.startswith("measured ") and "cached in" in read.source
    assert cache_home() != Path.home() / ".cache" / "onnx-partition"


def test_pinned_and_cached_cpu_in_the_summary(exported, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = exported("gpt")
    text = _text(capsys, _partition(model, "--stages", "2", "--cpu-tflops", "0.05", "-o",
                          tmp_path / "p"))
    assert ("priced by: analytic roofline of cpu:pinned, 0.05 TFLOP/s dense, 10 GB/s (pinned: "
            "0.05 TFLOP/s by --cpu-tflops, 10 GB/s assumed (--cpu-gbps sets it))") in text
    assert "link between stages: 10 GB/s, 0.02 ms (default)" in text
    plan = read_plan(tmp_path / "p")
    assert plan.device_model is not None and plan.device_model["peak_tflops"] == 0.05
    text = _text(capsys, _partition(model, "--stages", "2", "-o", tmp_path / "q"))
    assert "(measured " in text and f"cached in {cache_home() / CPU_SPEED_FILE}" in text
    first = read_plan(tmp_path / "q")
    again = _text(capsys, _partition(model, "--stages", "2", "-o", tmp_path / "q", "--force"))
    assert again.splitlines()[:4] == text.splitlines()[:4]  # the cached speed: the same plan
    second = read_plan(tmp_path / "q")
    assert second.predicted == first.predicted
    assert [s.nodes for s in second.stages] == [s.nodes for s in first.stages]
    one_error(capsys, _partition(model, "--stages", "2", "--gpu", "h100", "--cpu-tflops", "1",
                       "-o", tmp_path / "x"), "--cpu-tflops/--cpu-gbps price CPUs")
    one_error(capsys, _partition(model, "--stages", "2", "--cpu-tflops", "0", "-o",
                       tmp_path / "x"), "--cpu-tflops")
    assert not (tmp_path / "x").exists()


def test_named_gpu_brings_memory_and_link(exported, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = exported("gpt")
    text = _text(capsys, _partition(model, "--devices", "2", "--gpu", "h100", "-o",
                          tmp_path / "a"))
    assert ("devices: memory 79.5 GB per device (datasheet of the H100-SXM5-80GB, less 500 MB "
            "for the CUDA context; --device-memory to change); link within a machine 450 GB/s, "
            "0.005 ms (datasheet: NVLink 4 of the H100-SXM5-80GB, per direction); between "
            "machines 1.25 GB/s, 0.05 ms (default)") in text
    plan = read_plan(tmp_path / "a")
    assert plan.cluster["memory_gb"] == 79.5  # the CUDA context's 0.5 GB left out
    assert plan.cluster["intra"] == {"bandwidth_gbps": 450.0, "latency_ms": 0.005}
    assert plan.device_model is not None and "datasheet" in plan.device_model["sources"]["memory"]
    # options win, and say so
    text = _text(capsys, _partition(model, "--devices", "2", "--gpu", "l4", "--device-memory",
                          "16GB", "--bandwidth", "20", "-o", tmp_path / "b"))
    assert "memory 16 GB per device (--device-memory)" in text
    assert "link within a machine 20 GB/s, 0.01 ms (--bandwidth; the rest datasheet: PCIe 4.0 " \
           "x16 of the L4-24GB, per direction)" in text
    # cluster.json: its own figures, the GPU's where it gives none
    spec = tmp_path / "c.json"
    spec.write_text(json.dumps({"kind": "cuda", "gpu": "a100-40gb", "devices_per_machine": 2,
                                "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02}}))
    text = _text(capsys, _partition(model, "--cluster", spec, "-o", tmp_path / "c"))
    assert (f"devices: memory 39.5 GB per device (datasheet of the A100-SXM4-40GB, less 500 MB "
            f"for the CUDA context); link within a "
            f"machine 300 GB/s, 0.005 ms (datasheet: NVLink 3 of the A100-SXM4-40GB, per "
            f"direction); between machines 25 GB/s, 0.02 ms (cluster.json {spec})") in text
    # a plain pipeline on a named GPU: its link between stages
    text = _text(capsys, _partition(model, "--stages", "2", "--gpu", "h200", "-o",
                          tmp_path / "d"))
    assert "link between stages: 450 GB/s, 0.005 ms (datasheet: NVLink 4 of the H200" in text
    assert read_plan(tmp_path / "d").extra["link"] == {"bandwidth_gbps": 450.0,
                                                        "latency_ms": 0.005}


def test_train_defaults_to_what_the_plan_was_priced_for() -> None:
    """``train`` takes the plan's recorded optimizer, precision and schedule unless told, and
    says in one line when told otherwise; a plan that records none keeps the old defaults."""
    from support.cli import parser_that_never_runs_a_verb, verb_parsers

    from onnx_partition.cli.args import TRAIN_FALLBACKS, plan_defaults, train_options
    from onnx_partition.partition import TRAIN_ASSUMPTIONS

    train = verb_parsers(parser_that_never_runs_a_verb())["train"]
    parser = train
    args = parser.parse_args(["plan"])
    assert plan_defaults(args, TRAIN_ASSUMPTIONS) is None
    assert (args.optimizer, args.precision, args.schedule) == ("adamw", "fp32", "1f1b")
    args = parser.parse_args(["plan", "--optimizer", "sgd", "--schedule", "gpipe"])
    warning = plan_defaults(args, {"optimizer": "adam", "precision": "fp32",
                                   "schedule": "1f1b"})  # an early plan@2's spelling
    assert warning == ("warning: training with --optimizer sgd, --schedule gpipe; the plan was "
                       "priced for optimizer adamw, schedule 1f1b (plan.json): its predicted "
                       "time and memory assume those")
    assert (args.optimizer, args.precision, args.schedule) == ("sgd", "fp32", "gpipe")
    args = parser.parse_args(["plan"])
    assert plan_defaults(args, {}) is None
    assert {k: train_options(args)[k] for k in TRAIN_FALLBACKS} == TRAIN_FALLBACKS
