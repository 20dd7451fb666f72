"""``onnx-partition demo`` plans for the machine it runs on: one stage per CPU this process may
run on (at most four), priced by its own measurements, and it runs end to end."""

from __future__ import annotations

import json
import os

import pytest

from onnx_partition.cli import verbs
from onnx_partition.cost.profile import CACHE_ENV

MAIN = verbs.main  # the command itself, before a test stands in for the verbs it calls


def _steps(monkeypatch, argv: list[str]) -> list[list[str]]:
    """The commands ``demo argv`` would run, none of them run."""
    steps: list[list[str]] = []
    monkeypatch.setattr(verbs, "main", lambda step: steps.append(list(step)) or 0)
    assert MAIN(["demo", *argv]) == 0
    return steps


def _stages(steps: list[list[str]]) -> int:
    (partition,) = [s for s in steps if s[0] == "partition"]
    return int(partition[partition.index("--stages") + 1])


@pytest.mark.parametrize(("cpus", "stages"), [(1, 1), (2, 2), (3, 3), (4, 4), (16, 4)])
def test_stages_follow_the_affinity(monkeypatch, tmp_path, cpus, stages):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the affinity wins over the count
    assert _stages(_steps(monkeypatch, ["--workdir", str(tmp_path)])) == stages


def test_stages_follow_the_count_without_affinity(monkeypatch, tmp_path):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _stages(_steps(monkeypatch, ["--workdir", str(tmp_path)])) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one
    assert _stages(_steps(monkeypatch, ["--workdir", str(tmp_path)])) == 1


def test_prices_by_measurement_before_it_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    steps = _steps(monkeypatch, ["--workdir", str(tmp_path)])
    assert [s[0] for s in steps] == ["export", "profile", "partition", "profile", "run"]
    profile, partition, calibrate = steps[1], steps[2], steps[3]
    assert partition[partition.index("--costs") + 1] == profile[profile.index("-o") + 1]
    assert calibrate[:2] == ["profile", "--plan"] and "--check" in steps[4]


def test_more_stages_than_cpus_says_why_measured_falls_short(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert _stages(_steps(monkeypatch, ["--stages", "3", "--workdir", str(tmp_path)])) == 3
    assert "3 stages on 2 CPUs: the stages share CPUs" in capsys.readouterr().err


def test_a_busy_machine_is_said(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 2.0, 1.0), raising=False)
    _steps(monkeypatch, ["--workdir", str(tmp_path)])
    assert "load average was 3.00 on 2 CPUs" in capsys.readouterr().err
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2), raising=False)
    _steps(monkeypatch, ["--workdir", str(tmp_path)])
    assert "load average" not in capsys.readouterr().err


def test_demo_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profile-cache"))  # not the home's
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert verbs.main(["-q", "demo", "--workdir", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert len(plan["stages"]) == min(cpus or 1, verbs.DEMO_MAX_STAGES)
    assert plan["calibrated"]["rounds"]  # priced by its own stages' times, measured here
    assert (tmp_path / "costs.json").is_file() and (tmp_path / "gpt.onnx").is_file()
