"""The tables a model's integer inputs index (token ids into an embedding), so ``train --data``
can refuse ids outside them before any process starts (in the ranks they end the run with
torch's ``index out of range in self``).

An integer model input indexes a table when, through operators that keep its values
(:data:`KEEPS_VALUES`: reshapes, casts, slices), it reaches the indices of a ``Gather`` on
axis 0 whose data is an initializer of the stage that reads it: the table's rows are the range.
Anything else (arithmetic on the ids, a table computed at run time) is not followed, so no
range is claimed for it.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from onnx_partition.plan import Plan

__all__ = ["KEEPS_VALUES", "index_ranges"]

#: Operators whose first output holds (some of) their first input's values unchanged.
KEEPS_VALUES = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast",
                          "Slice", "Expand"})


def _table_rows(model: onnx.ModelProto, name: str) -> tuple[int, str] | None:
    """(rows, table name) of the smallest table that ``name``'s values index, or None."""
    tables = {t.name: list(t.dims) for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for position, value in enumerate(node.input):
            if position == 0 or (node.op_type == "Gather" and position == 1):
                readers.setdefault(value, []).append(node)
    found: list[tuple[int, str]] = []
    seen, todo = {name}, [name]
    while todo:
        value = todo.pop()
        for node in readers.get(value, []):
            if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == value:
                axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute
                             if a.name == "axis"), 0)
                dims = tables.get(node.input[0])
                if axis == 0 and dims:
                    found.append((int(dims[0]), node.input[0]))
            elif ((node.op_type in KEEPS_VALUES or node.op_type == "Gather")  # of the ids
                  and node.input[0] == value and node.output and node.output[0] not in seen):
                seen.add(node.output[0])
                todo.append(node.output[0])
    return min(found) if found else None


def index_ranges(plan_dir: Path, plan: Plan) -> dict[str, tuple[int, str]]:
    """Integer model input -> (rows, table) of the embedding it indexes, read from the stage
    files that take it (their graphs only, not external weights)."""
    wanted = {s.name for s in plan.inputs if s.dtype.startswith(("int", "uint"))}
    out: dict[str, tuple[int, str]] = {}
    for stage in plan.stages:
        names = wanted.intersection(stage.inputs) - set(out)
        if not names:
            continue
        model = onnx.load(str(plan_dir / stage.file), load_external_data=False)
        for name in sorted(names):
            rows = _table_rows(model, name)
            if rows is not None:
                out[name] = rows
    return out
