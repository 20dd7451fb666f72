"""Restart after a lost rank: ``train --max-restarts N --checkpoint-dir D`` restarts every rank
from D's newest complete checkpoint when one dies (``kill -9``), and ends as an uninterrupted
run ends; the restarts are reported, the replayed steps logged as replayed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoints import rank_params

from onnx_partition.cli.summary.train import format_train
from onnx_partition.errors import PartitionError, StageFailed
from onnx_partition.partition import partition
from onnx_partition.request.train import train_job
from onnx_partition.runtime.launch.hooks import KillOnce
from onnx_partition.runtime.train.restart import torchrun_resume
from onnx_partition.runtime.train.trainer import train_plan

ROOT = Path(__file__).resolve().parents[1]
MICROBATCHES = 2
OPTIONS = {"steps": 8, "microbatches": MICROBATCHES, "batch_size": 2, "optimizer": "adamw",
           "lr": 1e-3, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def plan(exported, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("restart") / "plan"
    partition(exported("gpt"), 2, folder, mode="train", check=False, batch_size=2)
    return folder


def _final(stats) -> dict[str, torch.Tensor]:
    return {f"{r.stage}:{n}": v for r in stats.ranks if r.state is not None
            for n, v in r.state.items()}


def test_a_killed_rank_restarts_from_the_newest_checkpoint(plan: Path, tmp_path: Path) -> None:
    straight = train_plan(plan, checkpoint_dir=tmp_path / "a", save=tmp_path / "sa", **OPTIONS)
    log = tmp_path / "log.jsonl"
    # rank 1 (the last stage) dies at its first forward of step 4: after the checkpoint of
    # step 2, with step 3 done since
    hook = KillOnce(str(tmp_path / "killed"), rank=1, at=3 * MICROBATCHES + 1)
    stats = train_plan(plan, checkpoint_dir=tmp_path / "b", save=tmp_path / "sb",
                       max_restarts=1, log=log, hook=hook, **OPTIONS)
    assert (tmp_path / "killed").exists()  # the rank was killed
    assert [{k: v for k, v in r.items() if k != "error"} for r in stats.restarts] == [
        {"failed_step": 4, "resumed_from_step": 2, "replayed_steps": [3]}]
    assert stats.start_step == 2 and len(stats.loss) == 6
    want, got = _final(straight), _final(stats)
    assert want.keys() == got.keys() and want
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
    assert stats.loss == pytest.approx(straight.loss[2:], abs=1e-5)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert [line["step"] for line in lines if line.get("replayed")] == [3]
    summary = format_train(stats)
    assert "restarted after a lost rank in step 4: resumed from step 2, step 3 replayed" \
        in summary


def test_without_restarts_a_killed_rank_ends_the_run(plan: Path, tmp_path: Path) -> None:
    hook = KillOnce(str(tmp_path / "killed"), rank=1, at=1)
    with pytest.raises(StageFailed, match="stage 1"):
        train_plan(plan, checkpoint_dir=tmp_path / "c", hook=hook, **OPTIONS)


def test_restarts_need_a_checkpoint_folder(plan: Path) -> None:
    with pytest.raises(PartitionError, match="--max-restarts needs --checkpoint-dir"):
        train_plan(plan, steps=2, max_restarts=1)
    with pytest.raises(PartitionError, match="--max-restarts must be >= 0"):
        train_plan(plan, steps=2, max_restarts=-1)


def test_a_worker_torchrun_restarted_resumes_from_the_checkpoint_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    job = train_job(checkpoint_dir=str(folder), checkpoint_every=2)
    assert torchrun_resume(job, {"TORCHELASTIC_RESTART_COUNT": "1"}) == job  # nothing to resume
    (folder / "step-00000002").mkdir(parents=True)
    (folder / "step-00000002" / "manifest.json").write_text("{}")
    assert torchrun_resume(job, {}).checkpoint.resume is None  # a first start: as given
    assert torchrun_resume(job, {"TORCHELASTIC_RESTART_COUNT": "0"}) == job
    assert torchrun_resume(job, {"TORCHELASTIC_RESTART_COUNT": "1"}).checkpoint.resume \
        == str(folder)


def test_torchrun_restarts_a_killed_worker_from_the_checkpoint(plan: Path, tmp_path: Path) -> None:
    """Under torchrun's own ``--max-restarts 1`` (2 workers, gloo): rank 1 is killed (``kill
    -9``) at its first forward of step 4; torchrun restarts both workers, which resume from the
    checkpoint of step 2 (``TORCHELASTIC_RESTART_COUNT`` 1) and end where an uninterrupted run
    ends: the final checkpoint's parameters within 1e-5, step 3 logged again."""
    straight = tmp_path / "straight"
    train_plan(plan, checkpoint_dir=straight, **OPTIONS)
    folder, log, marker = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "DRILL_MARKER": str(marker), "DRILL_RANK": "1",
           "DRILL_AT": str(3 * MICROBATCHES + 1)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "--max-restarts", "1", str(ROOT / "tests" / "support" / "torchrun_drill.py"),
         str(plan), "--steps", "8", "--microbatches", str(MICROBATCHES), "--batch-size", "2",
         "--optimizer", "adamw", "--lr", "1e-3", "--checkpoint-dir", str(folder),
         "--checkpoint-every", "2", "--log-file", str(log)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists()  # the worker was killed
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps[-6:] == [3, 4, 5, 6, 7, 8] and 3 in steps[:-6]  # step 3 again, after 2
    last = "step-00000008"
    for rank in (0, 1):
        want, got = rank_params(straight / last, rank), rank_params(folder / last, rank)
        assert want.keys() == got.keys() and want
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
