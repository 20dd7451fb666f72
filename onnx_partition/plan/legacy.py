"""``Plan.extra``: plan.json's extras as the dict they were before each was a typed field of
:class:`~onnx_partition.plan.contracts.PlanFields` — the compatibility path of code written
against that dict (``plan.extra["costs"]["backward"] = ...``), and of ``Plan(..., extra={...})``.

Each value reads as its JSON data; a dict or list value is live one level deep: a change to it
(an item set, a list appended to) is read back into the typed field. A key that plan.json does
not declare is an error when set. ``tests/test_plan_access.py`` keeps this path out of the
package (its allowance list names the modules still on it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterator, MutableMapping
from typing import Any

from onnx_partition.errors import PartitionError
from onnx_partition.plan.contracts import PlanFields
from onnx_partition.plan.declare import Record, json_of

__all__ = ["EXTRAS", "ExtraView", "extra_type", "holds_records"]

#: plan.json's extra keys: the fields of PlanFields beyond the plan's own.
EXTRAS = tuple(f.name for f in dataclasses.fields(PlanFields)
               if f.name not in (PlanFields.FIXED or ()))


@functools.cache
def extra_type(name: str) -> Any:
    """The declared type of extra ``name``."""
    return typing.get_type_hints(PlanFields, include_extras=True)[name]


def _default(name: str) -> Any:
    spec = next(f for f in dataclasses.fields(PlanFields) if f.name == name)
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


class ExtraView(MutableMapping[str, Any]):
    """The extras of ``plan`` (a :class:`~onnx_partition.plan.planfile.Plan`) as a dict of JSON
    data (the module docstring)."""

    def __init__(self, plan: PlanFields) -> None:
        self._plan = plan

    def _present(self) -> list[str]:
        return [k for k in self._plan._written() if k in EXTRAS]

    def __getitem__(self, key: str) -> Any:
        if key not in self._present():
            raise KeyError(key)
        value = json_of(getattr(self._plan, key))
        if isinstance(value, dict):
            return _LiveDict(self, key, value)
        if isinstance(value, list):
            return _LiveList(self, key, value)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in EXTRAS:
            close = difflib.get_close_matches(key, EXTRAS, n=1, cutoff=0.6)
            raise PartitionError(f"plan.json: unknown key {key!r}"
                                 + (f" (did you mean {close[0]!r}?)" if close else ""))
        from onnx_partition.plan.schema import parse  # pydantic: loaded when first needed

        typed = parse(extra_type(key), json_of(value), f"plan.json {key}")
        setattr(self._plan, key, typed)
        keys = self._plan.__dict__["_keys"]
        if key not in keys:  # set, even to an empty container: present, as a dict's key
            keys.append(key)

    def __delitem__(self, key: str) -> None:
        if key not in self._present():
            raise KeyError(key)
        setattr(self._plan, key, _default(key))
        keys = self._plan.__dict__["_keys"]
        if key in keys:
            keys.remove(key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self._present():
            self[key] = default
        return self[key]  # live, so that ``setdefault(k, []).append(x)`` is kept

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def __repr__(self) -> str:
        return repr(dict(self))


class _LiveDict(dict[str, Any]):
    """An extra's dict value whose changes are read back into the plan."""

    def __init__(self, view: ExtraView, key: str, data: dict[str, Any]) -> None:
        super().__init__(data)
        self._view, self._key = view, key

    def _sync(self) -> None:
        self._view[self._key] = dict(self)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._sync()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._sync()

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return super().__getitem__(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._sync()

    def pop(self, key: str, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._sync()
        return value


class _LiveList(list[Any]):
    """An extra's list value whose changes are read back into the plan."""

    def __init__(self, view: ExtraView, key: str, data: list[Any]) -> None:
        super().__init__(data)
        self._view, self._key = view, key

    def _sync(self) -> None:
        self._view[self._key] = list(self)

    def append(self, value: Any) -> None:
        super().append(value)
        self._sync()

    def extend(self, values: Any) -> None:
        super().extend(values)
        self._sync()

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._sync()


@functools.cache
def holds_records(name: str) -> bool:
    """Whether extra ``name``'s type holds records (a dict given for it is read into them)."""
    def records(hint: Any) -> bool:
        if isinstance(hint, type) and issubclass(hint, Record):
            return True
        return any(records(a) for a in typing.get_args(hint))
    return records(extra_type(name))
