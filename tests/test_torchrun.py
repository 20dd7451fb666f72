"""The torchrun entry of the distributed runtime: ``python -m onnx_partition.runtime.distributed``
under real ``torchrun`` (gloo, two ranks), and run's input handling and error lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from support.graphs import CHAIN, save
from support.outputs import assert_same, run_whole

from onnx_partition.partition import partition
from onnx_partition.runtime.dist.torchrun import torchrun_main

ROOT = Path(__file__).resolve().parents[1]


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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "onnx_partition.runtime.distributed", str(tmp_path / "plan"), "--iterations", "1",
         "--microbatches", "3", "--input", f"x={tmp_path / 'x.npy'}",
         "--output-dir", str(tmp_path / "out"), "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 ranks (gloo), batch 6 in 3 micro-batches" in done.stdout
    assert "rank 1 stage 1 replica 0 (cpu)" in done.stdout
    assert_same({"y": np.load(tmp_path / "out" / "y.npy")}, run_whole(model, {"x": x}))


def test_a_bad_input_file_is_one_error_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    partition(save(CHAIN, tmp_path / "m.onnx"), 2, tmp_path / "plan", batch_size=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    missing = tmp_path / "missing.npy"
    assert torchrun_main([str(tmp_path / "plan"), "--input", f"x={missing}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input 'x={missing}': cannot read {missing}")
    assert err.count("\n") == 1
    assert torchrun_main([str(tmp_path / "plan"), "--input", "z=a.npy"]) == 2
    assert capsys.readouterr().err == ("error: --input 'z=a.npy': expected NAME=FILE.npy with "
                                       "NAME one of x\n")
