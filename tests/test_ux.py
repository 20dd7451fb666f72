"""What a new user meets on the first day: CLI habits, the onnxruntime-style API, the early CUDA
check, packaging extras. Each test pins one item of issue 14 so it cannot come back."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from support.cli import parser_that_never_runs_a_verb, verb_parsers
from support.graphs import CHAIN, save

from onnx_partition import __version__
from onnx_partition.cli.summary.partition import plan_table
from onnx_partition.cli.summary.run import timing_line
from onnx_partition.cli.verbs import main
from onnx_partition.cost.cluster import Cluster, parse_bytes
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.progress import Bars, echo, iterate, loss_bar, progress_callback
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.distributed import run_distributed
from onnx_partition.solve.search import ORDERINGS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def chain(tmp_path):
    return save(CHAIN, tmp_path / "m.onnx")


@pytest.fixture
def plan_dir(tmp_path, chain):
    partition(chain, 2, tmp_path / "plan", batch_size=4)
    return tmp_path / "plan"


def cuda_plan(plan_dir: Path) -> Path:
    """The plan as if partitioned for two GPUs (stage files unchanged)."""
    body = json.loads((plan_dir / "plan.json").read_text())
    for k, stage in enumerate(body["stages"]):
        stage["devices"] = [f"cuda:{k}"]
    (plan_dir / "plan.json").write_text(json.dumps(body))
    return plan_dir


# ------------------------------------------------------------------------ the parser


def _all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = parser_that_never_runs_a_verb()
    return [("onnx-partition", parser), *sorted(verb_parsers(parser).items())]


def test_every_option_and_positional_has_help():
    for name, parser in _all_parsers():
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["partition", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 60.0)" in out and "(default: auto)" in out and "(default: 1)" in out
    assert "(default: None)" not in out and "(default: False)" not in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    demo = " ".join(capsys.readouterr().out.split())
    assert "pipeline stages (default: one per CPU" in demo and "(default: gpt)" in demo


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"onnx-partition {__version__}"


def test_torchrun_aliases():
    args = parser_that_never_runs_a_verb().parse_args(
        ["partition", "m.onnx", "-o", "p", "--nnodes", "2", "--nproc-per-node", "8"])
    assert (args.machines, args.devices) == (2, 8)
    actions = {a.dest: a for a in dict(_all_parsers())["partition"]._actions}
    assert "per machine" in actions["devices"].help
    run = {a.dest: a for a in dict(_all_parsers())["run"]._actions}
    assert "in total" in run["nproc"].help and "per machine" in run["nproc"].help


def test_quiet_verbose_and_singular(capsys, tmp_path, chain):
    assert main(["partition", str(chain), "-s", "1", "--batch-size", "2", "-o",
                 str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 stage and plan.json" in out and "stage  ops  copied consts" in out
    assert main(["-q", "partition", str(chain), "-s", "2", "--batch-size", "2", "-o",
                 str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "wrote" not in out and "copied consts" in out  # the result stays, chatter goes
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o",
                 str(tmp_path / "c"), "-q"]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o",
                 str(tmp_path / "d"), "-v"]) == 0
    assert logging.getLogger("onnx_partition").isEnabledFor(logging.DEBUG)
    out = capsys.readouterr().out
    assert "wrote 2 stages" in out and "debug: partition finished in" in out
    assert "debug: onnx-partition " in out


class _ClosedPipe(io.TextIOBase):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_closed_pipe_is_quiet_in_process(capsys, monkeypatch, plan_dir, chain, tmp_path):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["simulate", str(plan_dir)]) == 0
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o",
                 str(tmp_path / "p")]) == 0
    assert main(["-q", "report", str(plan_dir)]) == 0
    assert main(["report", str(plan_dir)]) == 0  # the "wrote" line, through logging
    assert capsys.readouterr().err == ""


def test_closed_pipe_is_quiet_in_a_shell(plan_dir):
    """`simulate ... | true` as a user types it: no traceback, exit 0 (pipefail on)."""
    cmd = (f"set -o pipefail; {sys.executable} -m onnx_partition.cli simulate {plan_dir} "
           f"| true")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


# ------------------------------------------------------------------------ sizes, batch, stats


@pytest.mark.parametrize(("text", "nbytes"), [
    ("16", 16e9), ("16G", 16e9), ("16GB", 16e9), ("16gb", 16e9), ("16 g", 16e9),
    ("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20), ("512M", 512e6), ("1.5T", 1.5e12),
    ("1e6B", 1e6), ("80GB", 80e9),
])
def test_sizes_as_people_type_them(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "16 GBs", "", "G", "-4G"])
def test_unreadable_sizes(text):
    with pytest.raises(PartitionError, match="cannot read a size"):
        parse_bytes(text)


def test_device_memory_is_echoed_and_bare_numbers_are_gb(capsys, tmp_path, chain):
    argv = ["partition", str(chain), "--devices", "2", "--batch-size", "3", "--microbatches",
            "4", "-o", str(tmp_path / "p")]
    assert main([*argv, "--device-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "device memory '16' read as 16 GB (16,000,000,000 bytes) per device" in out
    # the global batch written out, DeepSpeed's way
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    d = {s["replicas"] for s in plan["stages"]}
    assert "global batch = micro-batch size 3 x 4 micro-batches = 12 samples per iteration" in out
    if d == {2}:
        assert ("2 gradient accumulation steps x 2 data-parallel replicas" in out)
    assert main([*argv, "--device-memory", "16gb", "--force"]) == 0
    assert "read as 16 GB" in capsys.readouterr().out


def test_timing_statistics_exact():
    line = timing_line([4.0, 1.0, 3.0, 2.0])
    assert line == ("latency per iteration over 4 iterations: mean 2.50 ms, P50 2.50 ms, "
                    "P90 3.70 ms, P99 3.97 ms")


def test_run_prints_percentiles_and_plain_table_explains_consts(capsys, plan_dir):
    assert main(["run", str(plan_dir), "--iterations", "3", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 stages (1 + 1 replicas)" in out and "over 3 iterations: mean" in out and "P99" in out
    from onnx_partition.plan import read_plan

    assert "copied consts: constant nodes copied into the stage" in plan_table(
        read_plan(plan_dir))


# ------------------------------------------------------------------------ API like onnxruntime


def test_session_api_matches_onnxruntime(plan_dir, chain):
    whole = ort.InferenceSession(str(chain), providers=["CPUExecutionProvider"])
    with PipelineSession(plan_dir, microbatches=2) as session:
        for ours, theirs in ((session.get_inputs(), whole.get_inputs()),
                             (session.get_outputs(), whole.get_outputs())):
            assert [(a.name, a.type) for a in ours] == [(b.name, b.type) for b in theirs]
            assert [len(a.shape) for a in ours] == [len(b.shape) for b in theirs]
        assert session.get_inputs()[0].type == "tensor(float)"
        feeds = {"x": np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)}
        outputs = session.run(None, feeds)
        assert isinstance(outputs, list) and len(outputs) == 1
        np.testing.assert_allclose(outputs[0], whole.run(None, feeds)[0], rtol=1e-6)


def test_cuda_plan_fails_at_once_and_runs_on_cpu_on_request(capsys, plan_dir, chain):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    cuda_plan(plan_dir)
    began = time.perf_counter()
    with pytest.raises(PartitionError, match=r"run PLAN --device cpu"):
        PipelineSession(plan_dir)
    feeds = {"x": np.ones((4, 4), np.float32)}
    with pytest.raises(PartitionError, match=r"run PLAN --device cpu"):
        run_distributed(plan_dir, feeds, microbatches=2)
    assert time.perf_counter() - began < 5  # no process started, no session loaded
    assert main(["run", str(plan_dir)]) == 2
    assert "onnx-partition run PLAN --device cpu" in capsys.readouterr().err
    assert main(["run", str(plan_dir), "--device", "cpu", "--iterations", "1", "--check"]) == 0
    assert "(OK)" in capsys.readouterr().out
    # the multi-process runtime too (run_distributed(..., device="cpu")), with its percentiles
    assert main(["run", str(plan_dir), "--device", "cpu", "--nproc", "2", "--iterations", "2",
                 "--warmup", "1", "--check"]) == 0
    out = capsys.readouterr().out  # the CUDA plan ran (it fails at once without --device cpu)
    assert "latency per iteration over 2 iterations: mean" in out and "(OK)" in out


# ------------------------------------------------------------------------ progress, packaging


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal_with_eta(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert list(iterate(range(3), "run", total=3)) == [0, 1, 2]
    assert sys.stderr.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(iterate(range(3), "run", total=3)) == [0, 1, 2]
    tick = progress_callback("profiling")
    for done in range(1, 5):
        tick(done, 4)
    text = terminal.getvalue()
    assert "run:" in text and "/3 [" in text and "profiling:" in text and "/4 [" in text
    assert "<" in text  # tqdm's elapsed<remaining: the ETA
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    list(iterate(range(3), "run", total=3, enabled=False))
    assert quiet.getvalue() == ""


def test_train_lines_print_above_the_bar(monkeypatch):
    """train's step lines (:func:`echo`) go above rank 0's loss bar on one terminal (stdout and
    stderr alike): the bar is cleared first, so a line starts a line of its own (a plain print
    ran on after the bar's text: 'train: 33%|...| 1/3 [...]step 1: loss ...')."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", terminal)
    bar = loss_bar("train", 3)
    for step in (1, 2, 3):
        bar(step, 4.0)
        echo(f"step {step}: loss 4.0")
    lines = [line.split("\r")[-1] for line in terminal.getvalue().split("\n")]
    assert [line for line in lines if "step " in line] == [
        f"step {step}: loss 4.0" for step in (1, 2, 3)]
    assert "train:" in terminal.getvalue() and "loss 4.0000" in terminal.getvalue()


def test_a_rank_ending_abruptly_leaves_no_semaphore_behind():
    """A training rank makes its loss bar (drawn or not) and ends in ``os._exit`` as a failed
    rank does: no 'leaked semaphore' warning from the resource tracker (tqdm's default lock is
    a multiprocessing one; a failed run printed the warning under its one-line error)."""
    code = ("import multiprocessing, os\nfrom onnx_partition.progress import loss_bar\n"
            "multiprocessing.set_start_method('forkserver')  # as the ranks are started\n"
            "bar = loss_bar('train', 2)\nbar(1, 1.0)\nos._exit(1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert done.returncode == 1
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_gpu_extra_replaces_onnxruntime():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plain = [d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]]
    extras = project["optional-dependencies"]
    assert "onnxruntime" not in plain and "onnxruntime-gpu" not in plain
    assert any(d.startswith("onnxruntime-gpu") for d in extras["gpu"])
    assert not any(d.startswith("onnxruntime") and "gpu" not in d for d in extras["gpu"])
    assert any(d.startswith("onnxruntime>") for d in extras["cpu"])
    assert "onnx-partition[gpu]" in (ROOT / "README.md").read_text()
    assert '".[cpu,test]"' in (ROOT / "tools" / "setup.sh").read_text()


def test_long_library_loops_report_to_the_reporter_given(monkeypatch, tmp_path, chain):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    partition(chain, 2, tmp_path / "a", batch_size=2)
    assert terminal.getvalue() == ""  # a library user who passes no reporter sees nothing
    partition(chain, 2, tmp_path / "b", batch_size=2, cluster=Cluster(devices_per_machine=2),
              reporter=Bars())
    text = terminal.getvalue()
    assert "writing stage files:" in text and "planning: simulating proposals:" in text
    seen: list[tuple[str, int, int]] = []

    class Recorder:
        def step(self, label: str, done: int, total: int) -> None:
            seen.append((label, done, total))

    partition(chain, 2, tmp_path / "c", batch_size=2, reporter=Recorder())  # the plain search
    assert [s for s in seen if s[0] == "planning: orderings"][-1] == (
        "planning: orderings", len(ORDERINGS), len(ORDERINGS))
    assert [s for s in seen if s[0] == "writing stage files"] == [
        ("writing stage files", 1, 2), ("writing stage files", 2, 2)]


def test_the_command_line_draws_bars_unless_quiet(monkeypatch, tmp_path, chain):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = ["partition", str(chain), "-s", "2", "--batch-size", "2", "-o"]
    assert main([*argv, str(tmp_path / "a")]) == 0
    assert "planning: orderings:" in terminal.getvalue()
    assert "writing stage files:" in terminal.getvalue()
    assert main(["export", "resnet", "-o", str(tmp_path / "r.onnx")]) == 0
    assert "export resnet: build, trace and convert:" in terminal.getvalue()
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["-q", *argv, str(tmp_path / "b")]) == 0
    assert quiet.getvalue() == ""


def test_missing_onnxruntime_says_which_extra(plan_dir):
    """A Python without onnxruntime (an import of it fails, as when neither extra is
    installed): run says which extra to install, in one line."""
    script = ("import sys; sys.modules['onnxruntime'] = None\n"
              "from onnx_partition.cli import main\n"
              f"sys.exit(main(['run', {str(plan_dir)!r}]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    err = done.stderr
    assert err.startswith("error: onnxruntime is not installed") and "[gpu]" in err
    assert err.count("\n") == 1


def test_each_rank_of_run_nproc_reports_through_rank_0s_bar(tmp_path, plan_dir):
    """Rank 0 shows every rank's finished iterations: 2 ranks x 3 iterations, ending at 6."""
    import pickle

    from support.progress import FileProgress

    from onnx_partition.runtime.infer.worker import RankBar

    seen = FileProgress(tmp_path / "progress.txt")
    feeds = {"x": np.ones((4, 4), np.float32)}
    run_distributed(plan_dir, feeds, microbatches=2, iterations=3, progress=seen)
    calls = seen.calls()
    assert calls[-1] == (6, 6) and all(total == 6 for _, total in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and len(calls) == 4  # rank 0's 3 iterations, then the end
    bar = pickle.loads(pickle.dumps(RankBar(enabled=False)))
    bar(1, 2)  # a bar made in the process that calls it (here: none drawn, not a terminal)
    bar(2, 2)
