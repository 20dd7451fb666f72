"""How a JSON contract is declared: stdlib dataclasses whose fields carry their constraints as
:data:`typing.Annotated` metadata (``annotated_types.Ge``, ``MinLen``, ... and the markers
here), read by pydantic when a file is checked. One declaration is both the check and the type
the code uses; nothing here imports pydantic (the CLI starts without it):
:mod:`onnx_partition.plan.schema` builds the validators when a file is first read.

:class:`Record` is the base of every contract object. Its pydantic hook lets a JSON object stand
for the record while every value inside stays strict (``"2"`` is not an integer), and remembers
the object's key order. A record that was always a dataclass (``FIXED = None``) writes every
field in declaration order, None as null; one that began as a JSON object of optional keys
(plan.json's extras) writes its ``FIXED`` fields first, then the others in the order they were
given or set (as a dict would), each only while it holds a value; so a file reads and writes
back to the same text. A record also reads as its JSON object (``record["send_ms"]``,
``.get``, ``in``): the compatibility path of code written against the old dicts, which
``tests/test_plan_access.py`` keeps out of the package.

Markers: :class:`Finite` (a finite number; an integer stays an integer), :class:`Pattern`,
:class:`Check` (a value check raising ValueError), :class:`FromList` (a tuple given as an
array), :class:`OneOf` (a union picked by a function of the raw value), :class:`InfIsNull`
(JSON null stands for infinity), :class:`Nullable` (a field set to None is written as null).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from annotated_types import Ge, Le, MinLen

from onnx_partition.values import MAX_DIM, MAX_ELEMENTS, MAX_MS

__all__ = ["Check", "Count", "Dim", "Finite", "FromList", "InfIsNull", "Ms", "Name",
           "Nullable", "Number", "OneOf", "OptionalSha256", "Pattern", "Record", "RelPath",
           "Seconds", "Sha256", "dtype_name", "elements", "json_of", "record_names", "relative"]

# pydantic's hooks receive its schema handler; typed loosely here (pydantic is not imported)
_Handler = Any
_R = typing.TypeVar("_R", bound="Record")


# --------------------------------------------------------------------------- markers


def _keep_int(value: Any, handler: Callable[[Any], Any]) -> Any:
    checked = handler(value)
    return value if type(value) is int else checked


@dataclass(frozen=True)
class Finite:
    """A finite number: NaN and Infinity are refused (``Input should be a finite number``); an
    integer given stays an integer, so ``"comm_ms": 0`` reads and writes back as ``0``."""

    def __get_pydantic_core_schema__(self, source: Any, handler: _Handler) -> Any:
        from pydantic_core import core_schema

        schema = handler(source)
        if schema.get("type") == "float":
            schema["allow_inf_nan"] = False
        return core_schema.no_info_wrap_validator_function(_keep_int, schema)


@dataclass(frozen=True)
class Pattern:
    """A string matching ``regex`` (``String should match pattern '...'``)."""

    regex: str

    def __get_pydantic_core_schema__(self, source: Any, handler: _Handler) -> Any:
        schema = handler(source)
        schema["pattern"] = self.regex
        return schema


@dataclass(frozen=True)
class Check:
    """A value check after the type's: ``func`` returns the value or raises ValueError with the
    message (``stages[0].file: must be a path inside the plan folder``)."""

    func: Callable[[Any], Any]

    def __get_pydantic_core_schema__(self, source: Any, handler: _Handler) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.func, handler(source))


@dataclass(frozen=True)
class OneOf:
    """A union of records picked by ``pick(raw value)``, one of ``choices``' names (pydantic's
    callable discriminator): an error names the chosen record's field, not every member's."""

    pick: Callable[[Any], str]
    choices: tuple[tuple[str, type], ...]

    def __get_pydantic_core_schema__(self, source: Any, handler: _Handler) -> Any:
        from pydantic_core import core_schema

        return core_schema.tagged_union_schema(
            {name: handler.generate_schema(kind) for name, kind in self.choices},
            discriminator=self.pick)


@dataclass(frozen=True)
class FromList:
    """A tuple (``tuple[X, ...]``, a frozen record's sequence) given as a JSON array: checked as
    the list it is in the file (``List should have at least 1 item``), then made a tuple."""

    def __get_pydantic_core_schema__(self, source: Any, handler: _Handler) -> Any:
        from pydantic_core import core_schema

        schema = handler(source)
        if schema.get("type") != "tuple" or len(schema.get("items_schema", [])) != 1:
            return schema
        listed = core_schema.list_schema(schema["items_schema"][0],
                                         min_length=schema.get("min_length"),
                                         max_length=schema.get("max_length"))
        return core_schema.no_info_after_validator_function(tuple, listed)


def _none_is_inf(value: Any, handler: Callable[[Any], Any]) -> Any:
    return math.inf if value is None else handler(value)


@dataclass(frozen=True)
class InfIsNull:
    """JSON null stands for infinity (cluster.json's ``memory_gb``: no limit)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: _Handler) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_wrap_validator_function(_none_is_inf, handler(source))


@dataclass(frozen=True)
class Nullable:
    """A field of a :class:`Record` of optional keys that, set to None, is written as null
    (it was a dict's key set to None): ``batch_size`` of a graph without a batch dim."""


# --------------------------------------------------------------------------- value checks


def relative(path: str) -> str:
    """``path`` when it names a file inside the plan folder, else ValueError."""
    parts = path.replace("\\", "/").split("/")
    if path.startswith(("/", "\\")) or ".." in parts or not path.strip():
        raise ValueError("must be a path inside the plan folder")
    return path


def dtype_name(name: str) -> str:
    """``name`` when it is a numeric numpy dtype name (or ``unknown``), else ValueError."""
    if name != "unknown":
        import numpy as np  # a plan is being read: numpy is loaded by then

        try:
            kind: str = np.dtype(name).kind
        except TypeError:
            kind = "?"
        if kind not in "biufc":
            raise ValueError(f"is not a numeric dtype name (e.g. float32, int64, bool): {name!r}")
    return name


def elements(shape: list[Any]) -> list[Any]:
    """``shape`` when its fixed dims hold at most MAX_ELEMENTS elements, else ValueError."""
    if math.prod(d for d in shape if isinstance(d, int)) > MAX_ELEMENTS:
        raise ValueError(f"more than {MAX_ELEMENTS} elements")
    return shape


# --------------------------------------------------------------------------- aliases

Number = Annotated[float, Finite()]
Ms = Annotated[float, Ge(0), Le(MAX_MS), Finite()]
Seconds = Annotated[float, Ge(0), Finite()]
Count = Annotated[int, Ge(0), Le(1 << 62)]
Dim = Annotated[int, Ge(0), Le(MAX_DIM)]
Name = Annotated[str, MinLen(1)]
Sha256 = Annotated[str, Pattern(r"^[0-9a-f]{64}$")]
OptionalSha256 = Annotated[str, Pattern(r"^([0-9a-f]{64})?$")]  # empty: none recorded
RelPath = Annotated[str, Check(relative)]


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class _Field:
    name: str
    required: bool
    inf_is_null: bool
    nullable: bool


def _fields_of(cls: Any) -> tuple[_Field, ...]:
    return _fields_cached(cls)


@functools.cache
def _fields_cached(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for f in dataclasses.fields(cls):
        marks = _metadata(hints[f.name])
        found.append(_Field(f.name, f.default is dataclasses.MISSING
                            and f.default_factory is dataclasses.MISSING,
                            any(isinstance(m, InfIsNull) for m in marks),
                            any(isinstance(m, Nullable) for m in marks)))
    return tuple(found)


def _metadata(hint: Any) -> list[Any]:
    """The Annotated metadata of ``hint``, also inside ``X | None``."""
    if typing.get_origin(hint) is Annotated:
        return list(hint.__metadata__)
    return [m for arg in typing.get_args(hint) for m in _metadata(arg)]


def _names_of(cls: Any) -> frozenset[str]:
    return _names_cached(cls)


@functools.cache
def _names_cached(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _given_order(value: Any, handler: Callable[[Any], Any]) -> Any:
    record = handler(value)
    if isinstance(value, dict) and isinstance(record, Record) and record.FIXED is not None:
        object.__setattr__(record, "_keys", list(value))
    return record


class Record:
    """The base of every contract object (the module docstring): strict values, unknown keys
    refused, key order kept, and the record readable as its JSON object."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"strict": True, "extra": "forbid"}
    #: Fields written first, always, in declaration order (None as null); None: all of them.
    #: The other fields follow in the order given or set, each only while it holds a value.
    FIXED: ClassVar[tuple[str, ...] | None] = None
    #: Fields with a default in code that a file must still give (a link's bandwidth).
    FILE_REQUIRED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: _Handler) -> Any:
        from pydantic_core import core_schema

        schema = handler(source)
        if schema.get("type") != "dataclass":
            return schema
        schema["strict"] = False  # a JSON object stands for the record; its values stay strict
        for spec in schema.get("schema", {}).get("fields", []):
            if spec.get("name") in cls.FILE_REQUIRED and spec["schema"].get("type") == "default":
                spec["schema"] = spec["schema"]["schema"]  # no default in a file
        ref = schema.pop("ref", None)
        return core_schema.no_info_wrap_validator_function(_given_order, schema, ref=ref)

    def __post_init__(self) -> None:
        if self.FIXED is not None:  # the fields given a value in code, in declaration order
            fixed = self.FIXED
            object.__setattr__(self, "_keys", [
                f.name for f in _fields_of(type(self)) if f.name not in fixed
                and (f.required or not _empty(getattr(self, f.name)))])

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        keys = self.__dict__.get("_keys")
        if keys is None or name not in _names_of(type(self)):
            return
        spec = next(f for f in _fields_of(type(self)) if f.name == name)
        if value is None and not (spec.required or spec.nullable):
            if name in keys:
                keys.remove(name)
        elif name not in keys:
            keys.append(name)

    @classmethod
    def given(cls: type[_R], values: Mapping[str, Any]) -> _R:
        """The record of ``values`` (the code's own, not checked), its keys in their order."""
        record = cls(**values)
        if record.FIXED is not None:
            object.__setattr__(record, "_keys", [k for k in values if values[k] is not None])
        return record

    def _leave_out(self, name: str, value: Any) -> bool:
        """Whether a fixed field ``name`` holding ``value`` is left out of the file."""
        return False

    def _written(self) -> list[str]:
        """The keys this record writes, in order."""
        specs = _fields_of(type(self))
        fixed = self.FIXED if self.FIXED is not None else tuple(f.name for f in specs)
        out = [n for n in fixed if not self._leave_out(n, getattr(self, n))]
        keys = self.__dict__.get("_keys", [])
        names = _names_of(type(self))
        out += [k for k in keys if k not in fixed and (k in names or k in self.__dict__)]
        out += [f.name for f in specs if f.name not in fixed and f.name not in keys
                and (f.required or not _empty(getattr(self, f.name)))]
        return out

    # ---- the record read as its JSON object (the compatibility path; module docstring)

    def __eq__(self, other: object) -> bool:
        """A record declared ``eq=False`` is equal to its JSON object, and to a record of its
        type writing the same (a dataclass's own equality compares the fields)."""
        if isinstance(other, Mapping):
            return bool(json_of(self) == dict(other))
        if type(other) is type(self):
            return bool(json_of(self) == json_of(other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dict was

    def empty(self) -> bool:
        """Whether a record of optional keys holds none (it is then left out of the file)."""
        return self.FIXED is not None and not self._written()

    def __getitem__(self, key: str) -> Any:
        return json_of(self)[key]

    def get(self, key: str, default: Any = None) -> Any:
        return json_of(self).get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in json_of(self)

    def __setitem__(self, key: str, value: Any) -> None:
        """A field set from code that writes the old dict (a number, a string: records are set
        as typed fields)."""
        if key not in _names_of(type(self)) or isinstance(value, dict | list):
            raise KeyError(f"{type(self).__name__}[{key!r}]: set the typed field")
        setattr(self, key, value)

    def pop(self, key: str, *default: Any) -> Any:
        """The field's JSON value, left at None; ``default`` (else KeyError) when unset."""
        body = json_of(self)
        if key not in body:
            if default:
                return default[0]
            raise KeyError(key)
        setattr(self, key, None)
        return body[key]


def _empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, Record):
        return value.empty()
    return isinstance(value, dict | list) and not value


def json_of(value: Any) -> Any:
    """``value`` (a record, or lists and dicts of them) as JSON data."""
    if isinstance(value, Record):
        specs = {f.name: f for f in _fields_of(type(value))}
        body = {}
        for name in value._written():
            item = getattr(value, name)
            spec = specs.get(name)
            body[name] = (None if spec is not None and spec.inf_is_null and item == math.inf
                          else json_of(item))
        return body
    if isinstance(value, Mapping):
        return {k: json_of(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_of(v) for v in value]
    return value


@functools.cache
def record_names() -> frozenset[str]:
    """The names of every record class (a :class:`OneOf` names its choices so; an error's
    location leaves them out)."""
    found: set[str] = set()
    todo: list[type] = [Record]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return frozenset(found)
