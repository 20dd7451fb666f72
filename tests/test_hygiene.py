"""The tests reach the code only through its front doors: no test module imports another (shared
helpers live in ``support/``, fixtures in ``conftest.py``), no test patches a private name, and
no production module reads an environment variable of ours that is not a user feature (faults
go through the hooks of ``support/faults.py``). Read from the source, so a new back door fails
here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: Our environment variables that users set: the profile cache's folder, and the default
#: pricing of a train plan for this CPU (measured, or analytic on a shared runner; docs/guide.md).
USER_VARIABLES = {"ONNX_PARTITION_CACHE", "ONNX_PARTITION_TRAIN_PRICING"}


def _test_sources() -> dict[Path, ast.Module]:
    files = [*TESTS.glob("*.py"), *(TESTS / "support").glob("*.py")]
    return {f: ast.parse(f.read_text()) for f in files}


def test_no_test_imports_another_test_module_or_conftest():
    found = []
    for path, tree in _test_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0].startswith("test_") or n.split(".")[0] in (
                          "conftest", "tests")]
    assert not found, "\n".join(found)


def _private(target: ast.expr) -> bool:
    """A name such as ``_bars``, or a dotted string naming one (``"pkg._mod.NAME"``)."""
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        return any(part.startswith("_") and not part.startswith("__")
                   for part in target.value.split("."))
    return False


def test_no_test_patches_a_private_name():
    found = []
    for path, tree in _test_sources().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("setattr", "delattr", "patch", "object"):
                continue
            # monkeypatch.setattr(obj, "_name", ...), monkeypatch.setattr("a._b.c", ...),
            # mock.patch("a._b"), mock.patch.object(obj, "_name"); and obj._private as the target
            args = node.args[:2]
            private = any(_private(a) for a in args) or any(
                isinstance(a, ast.Attribute) and a.attr.startswith("_")
                and not a.attr.startswith("__") for a in args)
            if private:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "\n".join(found)


def test_production_code_reads_no_test_variables():
    ours = re.compile(r"ONNX_PARTITION_[A-Z_]+")
    found = []
    for path in [*(ROOT / "onnx_partition").rglob("*.py"), *(ROOT / "models").rglob("*.py")]:
        for name in set(ours.findall(path.read_text())) - USER_VARIABLES:
            found.append(f"{path.relative_to(ROOT)}: {name}")
    assert not found, "\n".join(found)
