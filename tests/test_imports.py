"""A command imports what it runs: building the parser (``--version``, any ``--help``) loads no
torch, onnxruntime or OR-Tools (nor numpy), and partitioning an inference plan loads no torch
(the verbs import their runtime when they run). Each check runs in a fresh interpreter, since
this one has imported everything already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.graphs import CHAIN, save

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "onnxruntime", "ortools", "numpy")


def _loaded_after(code: str) -> set[str]:
    """The modules of :data:`HEAVY` (top-level names) loaded after running ``code`` in a fresh
    interpreter."""
    script = (f"import sys\n{code}\n"
              f"print(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def _cli(argv: list[str]) -> str:
    return ("from onnx_partition.cli import main\n"
            f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
            "assert code in (0, None), code")


@pytest.mark.parametrize("argv", [["--version"], ["partition", "--help"], ["run", "--help"],
                                  ["train", "--help"]])
def test_the_parser_imports_no_runtime_or_solver(argv):
    assert _loaded_after(_cli(argv)) == set()  # not even numpy (0.1 s of --version)


def test_the_torchrun_entries_parsers_import_no_runtime():
    code = ("from onnx_partition.cli.args import rank_parser\n"
            "rank_parser('run'); rank_parser('train')")
    assert _loaded_after(code) == set()


def test_partitioning_an_inference_plan_imports_no_torch(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    argv = ["-q", "partition", str(model), "-s", "2", "--batch-size", "2", "-o",
            str(tmp_path / "plan")]
    loaded = _loaded_after(_cli(argv))
    assert "torch" not in loaded
    assert "ortools" not in loaded  # the dp solver's path; only --solver ilp loads OR-Tools
    assert (tmp_path / "plan" / "plan.json").is_file()


def test_the_ilp_solver_loads_or_tools_when_asked(tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    argv = ["-q", "partition", str(model), "-s", "2", "--batch-size", "2", "-o",
            str(tmp_path / "plan"), "--solver", "ilp", "--time-limit", "5"]
    assert "ortools" in _loaded_after(_cli(argv))
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["ilp"]["optimal"]


def test_the_package_loads_torch_on_first_use_of_export():
    assert _loaded_after("import onnx_partition") == set()
    assert "torch" in _loaded_after("import onnx_partition\nassert callable(onnx_partition.export)")


def test_the_package_imports_the_recipes_by_their_installed_name():
    """The recipes install as ``onnx_partition.models`` (setup.py); ``from models...`` works in a
    checkout only, and ``export --hf-config`` failed so anywhere else."""
    import ast

    wrong = []
    for path in sorted((ROOT / "onnx_partition").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                      if n == "models" or n.startswith("models.")]
    assert not wrong, wrong
