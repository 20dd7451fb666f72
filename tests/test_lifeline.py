"""Nothing left running: ranks, fork server and resource tracker die with the launcher of
``run --nproc``; a stopped rank is named by its stage, replica and rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.faults import StopAt
from support.graphs import CHAIN, save

from onnx_partition.cli import main
from onnx_partition.partition import partition
from onnx_partition.runtime import StageFailed
from onnx_partition.runtime.infer.processes import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rpartition(b")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, or a process gone, does not): its state in /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rpartition(b")")[2].split()[0] not in (b"Z", b"X")


def launch(plan: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "onnx_partition.cli", "run", str(plan), "--nproc", "2",
         "--iterations", "1000000000", "--microbatches", "2", "--batch-size", "2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_killing_the_launcher_ends_every_rank_within_10_s(tmp_path):
    """Two runs at once: one launcher gets SIGTERM, the other SIGKILL (no clean-up code runs)."""
    model = save(CHAIN, tmp_path / "m.onnx")
    plan = tmp_path / "plan"
    partition(model, 2, plan, batch_size=2)
    procs = {sig: launch(plan) for sig in (signal.SIGTERM, signal.SIGKILL)}
    left: dict[int, list[int]] = {}
    try:
        deadline = time.monotonic() + 120
        for proc in procs.values():
            while len(descendants(proc.pid)) < 4:  # fork server, resource tracker, two ranks
                assert proc.poll() is None and time.monotonic() < deadline, "never started"
                time.sleep(0.2)
        time.sleep(1.0)
        families = {sig: descendants(proc.pid) for sig, proc in procs.items()}
        for sig, proc in procs.items():
            os.kill(proc.pid, sig)
        killed = time.monotonic()
        while (any(alive(p) for family in families.values() for p in family)
               and time.monotonic() - killed < 10):
            time.sleep(0.1)
        left = {sig: [p for p in family if alive(p)] for sig, family in families.items()}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        for pids in left.values():
            for p in pids:
                os.kill(p, signal.SIGKILL)
    assert not any(left.values()), f"alive 10 s after the launcher was killed: {left}"


def test_a_stopped_rank_is_named(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    plan = tmp_path / "plan"
    partition(model, 2, plan, batch_size=2)
    feeds = {"x": np.ones((2, 4), np.float32)}
    with pytest.raises(StageFailed, match=r"stage 1 replica 0 \(rank 1, cpu\) stopped answering"):
        run_distributed(plan, feeds, nproc=2, timeout_s=2.0, iterations=3,
                        hook=StopAt(1, "compute"))


def test_timeout_is_an_option(capsys, tmp_path):
    assert main(["run", str(tmp_path), "--timeout", "0"]) == 2
    assert "--timeout must be a finite number > 0" in capsys.readouterr().err
