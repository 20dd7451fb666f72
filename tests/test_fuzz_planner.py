"""tools/fuzz_planner.py: a run over every kind passes and names its seed; a failing case
prints the line that replays it alone, and the run exits 1."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

from onnx_partition.solve.exact import Proof

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fuzz_planner.py"


def test_a_short_run_over_every_kind_passes_and_prints_its_seed():
    done = subprocess.run([sys.executable, str(TOOL), "--cases", "12", "--seed", "7"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "base seed 7" in done.stdout
    for kind in ("dag-sequence", "dag-planner", "dag-exact", "hybrid", "judge", "fleet"):
        assert f"| {kind} | 2 | 0 |" in done.stdout


def _load(monkeypatch):
    spec = importlib.util.spec_from_file_location("fuzz_planner", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fuzz_planner", tool)  # its dataclasses look it up
    spec.loader.exec_module(tool)
    return tool


def test_dag_exact_catches_a_proof_claimed_short_of_the_optimum(monkeypatch):
    """Seed 1512405116's DAG: ``best_split`` 51.21% above the optimum, which the exact pass
    reaches; an exact pass that called the given split proven must fail the check."""
    tool = _load(monkeypatch)
    seed = 1512405116
    assert tool.check_dag_exact(random.Random(seed), tool.Tally()) is None

    def claims_the_given_split(problem, stages, stage_of):
        ms = problem.bottleneck_ms(stage_of, stages)
        return Proof(list(stage_of), ms, 0.0, True, "cp-sat", 0.0, ms)  # bound: none

    monkeypatch.setattr(tool, "exact_split", claims_the_given_split)
    failure = tool.check_dag_exact(random.Random(seed), tool.Tally())
    assert failure is not None and failure.startswith("claims proven (cp-sat)")


def test_a_failure_prints_its_replay_line_and_exits_1(monkeypatch, capsys):
    tool = _load(monkeypatch)
    seen = []

    def odd_fails(rng, tally):
        seen.append(rng.random())
        return "odd" if len(seen) % 2 else None

    monkeypatch.setitem(tool.KINDS, "hybrid", odd_fails)
    assert tool.main(["--kind", "hybrid", "--seed", "40", "--cases", "3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL hybrid seed 40: odd" in out and "FAIL hybrid seed 42: odd" in out
    assert "replay: python tools/fuzz_planner.py --kind hybrid --seed 42 --cases 1" in out
    assert "| hybrid | 3 | 2 |" in out
