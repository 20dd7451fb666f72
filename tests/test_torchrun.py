"""The torchrun entries (:mod:`onnx_partition.cli.torchrun`): ``python -m
onnx_partition.runtime.distributed`` and ``python -m onnx_partition.train.runtime`` under real
``torchrun`` (gloo, two ranks), their options (the verbs' own), run's input handling, the
torchrun environment and the verbs' error lines."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.cli import verb_parsers
from support.graphs import CHAIN, save
from support.outputs import assert_same, run_whole

from onnx_partition.cli.args import build_parser, rank_parser
from onnx_partition.cli.torchrun import infer_main, train_main
from onnx_partition.errors import PartitionError, StageFailed
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.launch.ranks import (
    TorchrunEnv,
    check_world_size,
    rank_result,
    torchrun_env,
)
from onnx_partition.runtime.train.choices import TORCH_SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
#: What torchrun sets for rank 0 of 2 on one machine.
TORCHRUN_RANK0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *args], env=env, capture_output=True, text=True, timeout=300)


def test_two_ranks_under_torchrun_give_the_whole_models_outputs(tmp_path):
    """On a plan made for two GPUs, run on CPU by --device cpu (each rank's own option)."""
    model = save(CHAIN, tmp_path / "m.onnx")
    partition(model, 2, tmp_path / "plan", batch_size=2)
    body = json.loads((tmp_path / "plan" / "plan.json").read_text())
    for k, stage in enumerate(body["stages"]):
        stage["devices"] = [f"cuda:{k}"]
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(body))
    x = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = _torchrun("-m", "onnx_partition.runtime.distributed", str(tmp_path / "plan"),
                     "--iterations", "1", "--microbatches", "3", "--input",
                     f"x={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "out"),
                     "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "2 ranks (gloo), batch 6 in 3 micro-batches" in done.stdout
    assert "rank 1 stage 1 replica 0 (cpu)" in done.stdout
    assert_same({"y": np.load(tmp_path / "out" / "y.npy")}, run_whole(model, {"x": x}))


def test_two_training_ranks_under_torchrun_match_single_process_training(exported, tmp_path):
    plan = tmp_path / "plan"
    partition(exported("gpt"), 2, plan, batch_size=2, mode="train")
    log = tmp_path / "train.jsonl"
    done = _torchrun("-m", "onnx_partition.train.runtime", str(plan), "--steps", "2",
                     "--microbatches", "2", "--batch-size", "2", "--check", "--optimizer",
                     "adamw", "--lr-schedule", "cosine", "--clip-grad-norm", "0.05",
                     "--log-file", str(log), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--checkpoint-every", "2")
    assert done.returncode == 0, done.stderr
    planned = read_plan(plan).extra["schedule"]  # train's default: the plan's schedule
    assert (f"2 ranks (ours engine, {planned}, fp32 math), batch 4 = 2 micro-batches x 2 rows"
            in done.stdout)
    assert ("check against single-process training of the gradients of step 1 (adamw's "
            "parameters are not compared" in done.stdout and ": OK" in done.stdout)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    assert (tmp_path / "ckpt" / "step-00000002" / "manifest.json").is_file()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


@pytest.mark.parametrize("verb", ["run", "train"])
def test_a_rank_takes_its_verbs_options(verb):
    """One declaration: every option a rank shares with its verb is the verb's (flags, default,
    type, choices, help); a rank adds only how it joins its peers and where rank 0 saves."""
    theirs = _options(verb_parsers(build_parser({}.fromkeys(
        ("export", "profile", "partition", "run", "train", "simulate", "report", "demo"),
        lambda args: 0)))[verb])
    ours = _options(rank_parser(verb))
    assert set(ours) - set(theirs) == ({"backend", "output_dir"} if verb == "run"
                                       else {"backend"})
    for dest in set(ours) & set(theirs):
        a, b = ours[dest], theirs[dest]
        choices = b.choices
        if verb == "train" and dest == "schedule":  # a torchrun rank runs our engine only
            choices = [c for c in b.choices if c not in TORCH_SCHEDULES]
        assert (a.option_strings, a.default, a.type, a.choices) == \
            (b.option_strings, b.default, b.type, choices), dest
        if dest != "timeout":  # run's says "with --nproc: " first
            assert a.help == b.help, dest


def test_a_bad_input_file_is_one_error_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "plan", batch_size=2)
    for name, value in TORCHRUN_RANK0.items():
        monkeypatch.setenv(name, value)
    missing = tmp_path / "missing.npy"
    assert infer_main([str(tmp_path / "plan"), "--input", f"x={missing}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input 'x={missing}': cannot read {missing}")
    assert err.count("\n") == 1
    assert infer_main([str(tmp_path / "plan"), "--input", "z=a.npy"]) == 2
    assert capsys.readouterr().err == ("error: --input 'z=a.npy': expected NAME=FILE.npy with "
                                       "NAME one of x\n")
    assert infer_main([str(tmp_path / "plan"), "--iterations", "nan"]) == 2  # run's checks
    assert capsys.readouterr().err.count("\n") == 1


def test_training_an_inference_plan_is_one_error_line_and_exit_code_2(tmp_path, monkeypatch,
                                                                       capsys):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "plan", batch_size=2)
    for name, value in TORCHRUN_RANK0.items():
        monkeypatch.setenv(name, value)
    assert train_main([str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--mode train" in err and err.count("\n") == 1
    assert train_main([str(tmp_path / "plan"), "--lr", "nan"]) == 2  # train's checks
    assert capsys.readouterr().err.count("\n") == 1


def test_torchrun_env_reads_what_torchrun_sets():
    assert torchrun_env({**TORCHRUN_RANK0, "RANK": "1", "LOCAL_RANK": "1"}) == TorchrunEnv(
        rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="127.0.0.1",
        master_port=29500)
    # LOCAL_* default to one machine; two machines of two ranks name them
    one = {k: v for k, v in TORCHRUN_RANK0.items() if not k.startswith("LOCAL")}
    assert torchrun_env({**one, "RANK": "1"}).local_rank == 1
    two = {**TORCHRUN_RANK0, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert torchrun_env(two).local_world_size == 2


@pytest.mark.parametrize(("change", "message"), [
    ({"RANK": None}, "RANK is not set: start each rank with torchrun"),
    ({"WORLD_SIZE": None}, "WORLD_SIZE is not set"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
    ({"RANK": "one"}, "RANK='one' is not a whole number"),
    ({"WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' is not a whole number"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a whole number"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: need at least one rank"),
    ({"RANK": "2"}, r"RANK=2 is outside 0\.\.1 \(WORLD_SIZE=2\)"),
    ({"RANK": "-1"}, r"RANK=-1 is outside"),
    ({"LOCAL_WORLD_SIZE": "3"}, r"LOCAL_WORLD_SIZE=3 is outside 1\.\.2"),
    ({"LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is outside 0\.\.1"),
    ({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": None}, "LOCAL_RANK is not set"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port"),
])
def test_torchrun_env_errors_are_one_line(change, message):
    environ = {**TORCHRUN_RANK0, **change}
    environ = {k: v for k, v in environ.items() if v is not None}
    with pytest.raises(PartitionError, match=message) as caught:
        torchrun_env(environ)
    assert "\n" not in str(caught.value)


def test_a_rank_without_the_environment_is_bad_input(tmp_path, monkeypatch, capsys):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "plan", batch_size=2)
    for name in TORCHRUN_RANK0:
        monkeypatch.delenv(name, raising=False)
    assert infer_main([str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: WORLD_SIZE is not set: start each rank with torchrun")
    assert err.count("\n") == 1


def test_one_world_size_check():
    check_world_size([1, 2], 3)
    with pytest.raises(PartitionError, match=r"^the plan has 3 stage replicas \(1 \+ 2\); "
                                             r"got 4 processes$"):
        check_world_size([1, 2], 4)


def test_rank_zero_without_a_result_is_a_failed_run():
    """Both launchers and both torchrun ranks: exit code 1 (StageFailed), never 2."""
    assert rank_result(0, ("outputs", "stats"), "the inference ranks") == ("outputs", "stats")
    assert rank_result(1, None, "the training ranks") is None
    assert rank_result(1, "dropped", "the training ranks") is None
    with pytest.raises(StageFailed, match=r"^the training ranks finished without rank 0's"):
        rank_result(0, None, "the training ranks")
    assert not issubclass(StageFailed, PartitionError)
