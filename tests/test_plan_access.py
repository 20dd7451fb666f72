"""No string-keyed access to plan.json outside ``onnx_partition/plan/``: plan.json's fields are
typed (onnx_partition.plan.contracts, .extras), so the package reads ``plan.simulator_costs
.send_ms``, never ``plan.extra["simulator_costs"]["send_ms"]`` or ``plan.costs.get("check")``.

The check reads every module's syntax tree and names each use of the old dict of the extras
(``.extra``) and each string-keyed subscript, ``get``, ``pop`` or ``setdefault`` on a plan field
that holds records or dicts (``plan.cluster["memory_gb"]``), also through a name bound to one in
the same function (``sim = plan.simulator_costs; sim["step_ms"]``); tools/ too. ALLOWED names
the modules still on the old dicts, each with what converts it; an entry whose module no longer
needs it is an error, so the list only shrinks."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from onnx_partition.plan.contracts import PlanFields, Stage
from onnx_partition.plan.declare import Record

PACKAGE = Path(__file__).resolve().parents[1] / "onnx_partition"

#: Modules still reading plan.json by string keys, each converted by the lead after merging
#: issue 32's branches (they were being rewritten when plan.json's fields were typed).
ALLOWED: dict[str, str] = {
}

_GETTERS = {"get", "pop", "setdefault"}


def _record_fields() -> frozenset[str]:
    """The plan fields (and a stage's) whose values are records or containers of them."""
    names = set()
    for cls in (PlanFields, Stage):
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            if _holds(hints[f.name]):
                names.add(f.name)
    return frozenset(names)


def _holds(hint: object) -> bool:
    """Whether ``hint`` is a record or a dict (a list, such as ``stages``, is indexed by number:
    its items' fields are caught by their own names)."""
    if isinstance(hint, type) and issubclass(hint, Record):
        return True
    if typing.get_origin(hint) is dict:
        return True
    if typing.get_origin(hint) is list:
        return False
    return any(_holds(a) for a in typing.get_args(hint))


FIELDS = _record_fields()


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.bound: list[set[str]] = [set()]

    def _rooted(self, node: ast.expr) -> bool:
        """Whether ``node`` is (or unwraps to) a plan field holding records or dicts."""
        if isinstance(node, ast.BoolOp):
            return any(self._rooted(v) for v in node.values)
        if isinstance(node, ast.Subscript):
            return self._rooted(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _GETTERS:
            return self._rooted(node.func.value)
        if isinstance(node, ast.Attribute):
            return node.attr in FIELDS or node.attr == "extra"
        return isinstance(node, ast.Name) and node.id in self.bound[-1]

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.bound.append(set())
        self.generic_visit(node)
        self.bound.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._rooted(node.value):
            self.bound[-1].update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "extra":
            self.found.append((node.lineno, "the old dict of the extras (.extra)"))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                and self._rooted(node.value):
            self.found.append((node.lineno, f"[{key.value!r}]"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _GETTERS and node.args \
                and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and self._rooted(func.value):
            self.found.append((node.lineno, f".{func.attr}({node.args[0].value!r})"))
        self.generic_visit(node)


def accesses(path: Path) -> list[tuple[int, str]]:
    finder = _Finder()
    finder.visit(ast.parse(path.read_text(), str(path)))
    return finder.found


def test_no_string_keyed_plan_access_outside_plan():
    found, still = [], set()
    tools = sorted((PACKAGE.parent / "tools").glob("*.py"))
    for path in [*sorted(PACKAGE.rglob("*.py")), *tools]:
        name = path.relative_to(PACKAGE).as_posix() if PACKAGE in path.parents else \
            path.relative_to(PACKAGE.parent).as_posix()
        if name.startswith("plan/"):
            continue
        hits = accesses(path)
        if name in ALLOWED:
            if hits:
                still.add(name)
            continue
        found += [f"{name}:{line}: {what}" for line, what in hits]
    assert not found, "string-keyed plan.json access (use the typed fields):\n" + "\n".join(
        found)
    assert still == set(ALLOWED), f"no longer on the old dicts, drop from ALLOWED: " \
                                  f"{sorted(set(ALLOWED) - still)}"


def test_the_check_finds_each_old_spelling(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "def f(plan):\n"
        "    a = plan.extra.get('schedule')\n"
        "    b = plan.simulator_costs['send_ms']\n"
        "    c = (plan.device_model or {}).get('sources')\n"
        "    sim = plan.simulator_costs\n"
        "    sim['step_ms'] = [1.0]\n"
        "    d = plan.cluster.get('memory_gb')\n"
        "    e = plan.stages[0].predicted['compute_ms']\n"
        "    return plan.simulator_costs.send_ms, plan.predicted.iteration_ms, costs['x']\n")
    lines = [line for line, _ in accesses(source)]
    assert lines == [2, 2, 3, 4, 6, 7, 8]  # line 2: .extra and its get
