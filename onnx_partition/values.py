"""One validation layer for every number a user gives: finite, in range, of the right type.

The command line's numeric options (through :func:`install`, which wraps each option's argparse
type), ``--input-shape`` dims, byte sizes such as ``80GB``, and the JSON files' numbers (through
the bounds :mod:`onnx_partition.plan.contracts` declares from the constants here) all pass
through the same checks, and a bad value is a :class:`~onnx_partition.errors.PartitionError`
naming the option, its unit and the value:
``--bandwidth must be a finite number >= 0 GB/s, got nan``.

Every size the user controls is bounded, so that no option can make the tool allocate without
limit (``--microbatches 100000000`` is refused, not simulated).

Printing numbers back (:func:`sig3`, :func:`fmt_bytes`) is here too, in one format everywhere.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any

from onnx_partition.errors import PartitionError

__all__ = ["MAX_BATCH", "MAX_BYTES", "MAX_COUNT", "MAX_DEVICES", "MAX_DIM", "MAX_ELEMENTS",
           "MAX_GBPS", "MAX_MICROBATCHES", "MAX_MS", "MAX_REPLICAS", "MAX_SECONDS",
           "MAX_STAGES", "OPTIONS", "OptionType", "Rule", "check", "device_index",
           "fmt_bytes", "input_shape", "install", "sig3"]

#: Upper bounds of the sizes a user controls (a plan beyond them is not runnable by this tool).
MAX_STAGES = 4096
MAX_DEVICES = 65536  # in a cluster, all machines together
MAX_REPLICAS = MAX_DEVICES  # per stage: it may have every device (a process per replica)
MAX_MICROBATCHES = 4096
MAX_BATCH = 1 << 24  # rows
MAX_DIM = (1 << 31) - 1  # one input dim
MAX_ELEMENTS = 1 << 40  # elements of one input tensor
MAX_GBPS = 1e6  # GB/s
MAX_MS = 1e9  # ms (about 11 days)
MAX_SECONDS = 1e6
MAX_BYTES = 1e18  # 1 EB
MAX_COUNT = 1 << 31  # repetitions, iterations, a random seed


@dataclass(frozen=True)
class Rule:
    """A number's kind (``int`` or ``float``), its closed range and unit; ``low_open`` makes the
    lower bound exclusive (``> 0`` rather than ``>= 0``)."""

    kind: type
    low: float
    high: float
    unit: str = ""
    low_open: bool = False

    def describe(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.kind is int:
            return f"an integer from {_fmt(self.low)} to {_fmt(self.high)}{unit}"
        low = f"{'>' if self.low_open else '>='} {_fmt(self.low)}"
        return f"a finite number {low} and <= {_fmt(self.high)}{unit}"


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


def check(value: Any, name: str, rule: Rule) -> Any:
    """``value`` (a number, or the text of one) as ``rule.kind`` when it is finite and in
    range; else a PartitionError naming ``name``, the rule and the value."""
    bad = PartitionError(f"{name} must be {rule.describe()}, got {_show(value)}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        value = _parse(value.strip(), rule.kind)
        if value is None:
            raise bad
    if rule.kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise bad
    elif isinstance(value, int | float):
        value = float(value)
    else:
        raise bad
    if not math.isfinite(value) or value > rule.high:
        raise bad
    if value < rule.low or (rule.low_open and value == rule.low):
        raise bad
    return value


def _parse(text: str, kind: type) -> int | float | None:
    if kind is int:
        return int(text) if re.fullmatch(r"[+-]?\d{1,30}", text) else None
    try:
        return float(text) if len(text) < 64 else None
    except ValueError:
        return None


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- the command line

_RATE = Rule(float, 0.0, MAX_GBPS, "GB/s")
_LATENCY = Rule(float, 0.0, MAX_MS, "ms")

#: Numeric options by argparse ``dest``; the same name means the same thing in every verb.
OPTIONS: dict[str, Rule] = {
    "stages": Rule(int, 1, MAX_STAGES, "stages"),
    "batch_size": Rule(int, 1, MAX_BATCH, "rows"),
    "microbatches": Rule(int, 1, MAX_MICROBATCHES, "micro-batches"),
    "chunks": Rule(int, 1, MAX_STAGES, "chunks"),
    "bandwidth": _RATE,
    "inter_bandwidth": _RATE,
    "latency": _LATENCY,
    "inter_latency": _LATENCY,
    "cpu_tflops": Rule(float, 0.0, 1e6, "TFLOP/s", low_open=True),
    "cpu_gbps": Rule(float, 0.0, MAX_GBPS, "GB/s", low_open=True),
    "time_limit": Rule(float, 0.0, MAX_SECONDS, "s", low_open=True),
    "exact_budget": Rule(float, 0.0, MAX_SECONDS, "s"),  # 0 = off
    "timeout": Rule(float, 0.0, MAX_SECONDS, "s", low_open=True),
    "devices": Rule(int, 1, MAX_DEVICES, "devices"),
    "machines": Rule(int, 1, MAX_DEVICES, "machines"),
    "nproc": Rule(int, 1, MAX_DEVICES, "processes"),
    "repeats": Rule(int, 1, MAX_COUNT),
    "rounds": Rule(int, 1, 100, "rounds"),
    "threads": Rule(int, 1, 4096, "threads"),
    "threads_per_stage": Rule(int, 1, 4096, "threads"),
    "iterations": Rule(int, 1, MAX_COUNT),
    "warmup": Rule(int, 0, MAX_COUNT),
    "seed": Rule(int, 0, MAX_COUNT),
}
#: Options not listed above: any finite value representable by the tool.
_ANY_INT = Rule(int, -MAX_COUNT, MAX_COUNT)
_ANY_FLOAT = Rule(float, -1e300, 1e300)


@dataclass(frozen=True)
class OptionType:
    """An argparse ``type`` that checks ``rule`` and raises PartitionError (one line) on a bad
    value of option ``flag``."""

    flag: str
    rule: Rule

    def __call__(self, text: str) -> Any:
        return check(text, self.flag, self.rule)


def install(parser: argparse.ArgumentParser) -> None:
    """Give every ``int``/``float`` option of ``parser`` and its sub-commands a checking type:
    :data:`OPTIONS` by its ``dest``, else any finite value. Call once after building the
    parser; parse inside the ``except PartitionError`` of the command's main."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                install(sub)
            continue
        if action.type not in (int, float):
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.dest)
        rule = OPTIONS.get(action.dest) or (_ANY_INT if action.type is int else _ANY_FLOAT)
        if rule.kind is not action.type:
            rule = Rule(action.type, rule.low, rule.high, rule.unit, rule.low_open)
        action.type = OptionType(flag, rule)


# --------------------------------------------------------------------------- shapes and sizes


def input_shape(item: str) -> tuple[str, list[int]]:
    """``NAME=2,3,224`` (or ``2x3x224``) -> (NAME, [2, 3, 224]): every dim an integer in
    1..MAX_DIM and the product at most MAX_ELEMENTS; else a one-line error."""
    name, sep, text = item.rpartition("=")
    parts = [d for d in text.replace("x", ",").split(",") if d.strip()]
    if not sep or not name or not parts or not all(re.fullmatch(r"\s*[+-]?\d+\s*", d)
                                                   for d in parts):
        raise PartitionError(f"--input-shape {_show(item)}: expected NAME=D0,D1,... (integers)")
    dims = [check(d, f"--input-shape {name} dim {i}", Rule(int, 1, MAX_DIM))
            for i, d in enumerate(parts)]
    if math.prod(dims) > MAX_ELEMENTS:
        raise PartitionError(f"--input-shape {name}: {math.prod(dims)} elements is more than "
                             f"{MAX_ELEMENTS}")
    return name, dims


_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


def device_index(device: str) -> int | None:
    """A device name: ``cpu`` -> None, ``cuda`` / ``cuda:N`` -> its CUDA index (0 / N); else
    a PartitionError. Whether this machine has CUDA is the caller's question."""
    match = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if match is None:
        raise PartitionError(f"unknown device {device!r} (use cpu or cuda:N)")
    return None if device == "cpu" else int(match.group(1) or 0)


# --------------------------------------------------------------------------- printing numbers


def sig3(x: float) -> str:
    """Three significant digits, thousands separators, never scientific notation:
    ``236,800 -> 237,000``, ``45.91 -> 45.9``, ``0.001234 -> 0.00123``, ``2.0 -> 2``."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    digits = math.floor(math.log10(abs(x)))
    decimals = max(0, 2 - digits)
    rounded = round(x, 2 - digits)
    if rounded and math.floor(math.log10(abs(rounded))) > digits:  # 9.996 -> 10.0
        decimals = max(0, decimals - 1)
    text = f"{rounded:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_bytes(n: float) -> str:
    """A byte count in decimal units, three significant digits: ``1260 -> 1.26 kB``,
    ``1.5e12 -> 1,500 GB``, ``260 -> 260 B``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{sig3(n / scale)} {unit}"
    return f"{n:.0f} B"
