"""Training data (``train --data``): arrays named as the model's inputs plus the targets, read in
a fixed order.

**Files.** A ``.npz``, or a folder of ``.npy`` files (memory-mapped, so a data set larger than
RAM works), or (Python) a mapping of arrays. Its arrays are named as the model's inputs, plus the
targets: ``labels`` (or one array per model output, named as the output); all have the rows on
axis 0, as many each. Labels are taken as given (already shifted for next-token training).

**Order contract.** With ``S = B x M`` rows per step, step ``k`` takes rows ``k S .. (k+1) S``
of the data in order (micro-batch ``m`` of that step its rows ``m B .. (m+1) B``), wrapping at
the end of the data (an epoch). ``shuffle=SEED`` permutes the rows once per epoch, reproducibly
(:func:`epoch_order`). Only the ranks that need data read it: stage 0 its inputs, the last stage
the targets, each only the rows of the micro-batch its action takes, when it comes
(:class:`ArrayBatches` gives a step's rows as a :class:`~onnx_partition.runtime.train.rows.
StepRows`; issue 33). A folder of ``.npy`` is memory-mapped, and so is every array of a
``.npz`` stored uncompressed (``numpy.savez``): a micro-batch reads only its rows. A compressed
``.npz`` (``savez_compressed``) cannot be mapped: each rank reading it loads its arrays whole.

**A factory** (Python ``train_plan(data=callable)``): called once in each rank that reads data
(stage 0 and the last stage, and the parent for ``check``), it returns an iterable of whole-step
batches, each a mapping by name (model inputs and targets) or a pair ``(inputs, targets)`` of
mappings, of arrays or tensors. **Every rank that reads data must yield the same batches in the
same order** (seed your shuffling; do not shard by rank): the pipeline's stage 0 and last stage
must see the same rows. A factory's data is not checked before the processes start. A rank
holds each batch the factory yields whole for its step (it cuts its micro-batches from it): a
factory's batch is the one thing a rank's memory holds for all ``M`` micro-batches.

**Checks** (:func:`check_data`, before any process starts, one line each): every array the
model and the loss need, dtypes and trailing shapes, at least one step of rows, no NaN in float
inputs, labels inside the vocabulary (or ``-100``), ids inside the embedding they index; the
last three scan in chunks only the rows the run will read.
"""

from __future__ import annotations

import functools
import os
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan
from onnx_partition.runtime.train.loss import IGNORE_INDEX, resolve_loss
from onnx_partition.runtime.train.rows import StepRows

__all__ = ["ArrayBatches", "ArraySource", "DataInfo", "FactoryBatches", "check_data",
           "epoch_order", "rows_read"]

Tensors = dict[str, torch.Tensor]
Factory = Callable[[], Iterable[Any]]
CHUNK_BYTES = 64 << 20  # what one chunk of a scan reads at most


class ArraySource:
    """Named arrays from a ``.npz``, a folder of ``.npy`` (memory-mapped) or a mapping; opened
    lazily and picklable (a path travels as a path)."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, Any],
                 flag: str = "--data") -> None:
        self.path: Path | None = None
        self.given: dict[str, np.ndarray] | None = None
        if isinstance(source, Mapping):
            self.given = {str(k): np.asarray(v) for k, v in source.items()}
        else:
            self.path = Path(source)
            if not self.path.exists():
                raise PartitionError(f"{flag} {self.path}: no such file or folder")
            if not (self.path.is_dir() or self.path.suffix == ".npz"):
                raise PartitionError(f"{flag} {self.path}: expected a .npz file or a folder of "
                                     ".npy files")
        self._cache: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def describe(self) -> str:
        return str(self.path) if self.path is not None else "the arrays given"

    def headers(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Every array's shape and dtype, read without loading the arrays."""
        if self.given is not None:
            return {n: (a.shape, a.dtype) for n, a in self.given.items()}
        assert self.path is not None
        out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        try:
            if self.path.is_dir():
                for f in sorted(self.path.glob("*.npy")):
                    a = np.load(f, mmap_mode="r", allow_pickle=False)
                    out[f.stem] = (a.shape, a.dtype)
            else:
                with zipfile.ZipFile(self.path) as z:
                    for member in z.namelist():
                        if not member.endswith(".npy"):
                            continue
                        with z.open(member) as fh:
                            version = np.lib.format.read_magic(fh)
                            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                    else np.lib.format.read_array_header_2_0)
                            shape, _, dtype = read(fh)
                        out[member[:-4]] = (tuple(shape), np.dtype(dtype))
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise PartitionError(f"--data {self.path}: cannot read it ({exc})") from exc
        if not out:
            raise PartitionError(f"--data {self.path}: holds no arrays")
        for name, (_, dtype) in out.items():
            if dtype.hasobject:  # a pickle inside: never loaded (allow_pickle=False)
                raise PartitionError(f"--data {self.path}: array {name!r} holds Python objects "
                                     f"(dtype {dtype}); only plain numeric arrays are read")
        return out

    def array(self, name: str) -> np.ndarray:
        """The array ``name`` (a memory map for a folder of ``.npy``), cached."""
        if name not in self._cache:
            if self.given is not None:
                self._cache[name] = self.given[name]
            else:
                assert self.path is not None
                if self.path.is_dir():
                    self._cache[name] = np.load(self.path / f"{name}.npy", mmap_mode="r",
                                                 allow_pickle=False)
                else:
                    self._cache[name] = _npz_array(self.path, name)
        return self._cache[name]


def _npz_array(path: Path, name: str) -> np.ndarray:
    """Array ``name`` of the ``.npz`` ``path``: memory-mapped when its member is stored
    uncompressed (the zip's local header, then the ``.npy`` header, give its bytes' offset),
    else loaded whole."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"{name}.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        with np.load(path, allow_pickle=False) as npz:
            return np.asarray(npz[name])
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        local = fh.read(30)  # the local file header: name and extra field lengths at 26, 28
        fh.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little")
                + int.from_bytes(local[28:30], "little"))
        version = np.lib.format.read_magic(fh)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(fh)
        offset = fh.tell()
    if not shape or int(np.prod(shape)) == 0:
        with np.load(path, allow_pickle=False) as npz:
            return np.asarray(npz[name])
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape),
                     order="F" if fortran else "C")


def epoch_order(rows: int, epoch: int, shuffle: int | None) -> np.ndarray | None:
    """The row order of ``epoch``: None (in order) without ``shuffle``, else a permutation
    drawn from ``(shuffle, epoch)``."""
    if shuffle is None:
        return None
    return np.random.default_rng([shuffle, epoch]).permutation(rows)


def step_rows(rows: int, per_step: int, step: int, shuffle: int | None) -> np.ndarray:
    """The data rows of step ``step`` (0-based), in order (the order contract)."""
    positions = np.arange(step * per_step, (step + 1) * per_step, dtype=np.int64)
    epochs, index = np.divmod(positions, rows)
    if shuffle is None:
        return index
    out = np.empty_like(index)
    for e in np.unique(epochs):
        order = epoch_order(rows, int(e), shuffle)
        assert order is not None
        out[epochs == e] = order[index[epochs == e]]
    return out


def rows_read(rows: int, per_step: int, steps: int, shuffle: int | None, start: int = 0
              ) -> np.ndarray | None:
    """The sorted distinct rows that steps ``start .. steps`` read; None when that is all."""
    if (steps - start) * per_step >= rows:
        return None
    got = np.concatenate([step_rows(rows, per_step, s, shuffle) for s in range(start, steps)])
    return np.unique(got)


def _take(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``array[index]``, one slice when the rows are consecutive (a memory map reads only
    them)."""
    if len(index) and index[-1] - index[0] == len(index) - 1 and np.all(np.diff(index) == 1):
        return np.asarray(array[int(index[0]):int(index[-1]) + 1])
    return np.asarray(array[index])


def _rows(source: ArraySource, names: Iterable[str], index: np.ndarray) -> StepRows:
    """A step's rows ``index`` of the arrays ``names``, each range read when taken (a memory
    map reads only its rows)."""
    def take(lo: int, hi: int, wanted: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: torch.from_numpy(np.array(_take(source.array(n), index[lo:hi])))
                for n in wanted}

    def shapes() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        arrays = {n: source.array(n) for n in names}
        return {n: ((len(index), *a.shape[1:]), torch.from_numpy(np.zeros(0, a.dtype)).dtype)
                for n, a in arrays.items()}

    names = list(names)
    return StepRows(names, len(index), take, shapes)


@dataclass
class ArrayBatches:
    """``batches(step)`` of named arrays by the order contract: (inputs, targets), each array
    read only when a rank asks for it."""

    source: ArraySource
    inputs: list[str]
    targets: list[str]
    rows: int  # rows in the data
    per_step: int  # B x M
    shuffle: int | None = None

    def __call__(self, step: int) -> tuple[StepRows, StepRows]:
        index = step_rows(self.rows, self.per_step, step, self.shuffle)
        return _rows(self.source, self.inputs, index), _rows(self.source, self.targets, index)


class FactoryBatches:
    """``batches(step)`` from a factory's iterable (see the module docstring), called on first
    use; steps are asked for in order, and a later step first skips the batches before it (a
    run resumed at step ``k`` reads the factory's batch ``k``, as the run it continues would
    have)."""

    def __init__(self, factory: Factory, inputs: Iterable[str]) -> None:
        self.factory, self.inputs = factory, set(inputs)
        self._it: Iterator[Any] | None = None
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_it": None, "_next": 0}

    def __call__(self, step: int) -> tuple[Tensors, Tensors]:
        if self._it is None:
            self._it = iter(self.factory())
        if step < self._next:
            raise PartitionError(f"the data factory's batches are read in order: asked for "
                                 f"step {step + 1} after step {self._next}")
        while True:
            try:
                batch = next(self._it)
            except StopIteration:
                raise PartitionError(f"the data factory ran out of batches at step "
                                     f"{self._next + 1}") from None
            self._next += 1
            if self._next > step:
                break
        if isinstance(batch, Mapping):
            pairs = {str(k): _tensor(v) for k, v in batch.items()}
            return ({k: v for k, v in pairs.items() if k in self.inputs},
                    {k: v for k, v in pairs.items() if k not in self.inputs})
        inputs, targets = batch
        return ({str(k): _tensor(v) for k, v in inputs.items()},
                {str(k): _tensor(v) for k, v in targets.items()})


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))


@dataclass(frozen=True)
class DataInfo:
    """What :func:`check_data` found: the loss resolved, the target arrays read and the rows."""

    loss: str  # cross_entropy, mse, output (or custom)
    targets: list[str]
    rows: int


def check_data(plan: Plan, source: ArraySource, *, per_step: int, steps: int,
               shuffle: int | None, loss: str, custom: bool = False, start: int = 0,
               flag: str = "--data",
               ranges: Mapping[str, tuple[int, str]] | None = None) -> DataInfo:
    """Refuse data the run cannot train on (see the module docstring); the loss ``auto``
    stands for and the targets read. ``ranges``: integer input -> (rows, name) of the table it
    indexes (:func:`~onnx_partition.runtime.train.vocab.index_ranges`), its ids scanned."""
    where = f"{flag} {source.describe()}"
    headers = source.headers()
    fixed = plan.input_shapes
    for spec in plan.inputs:
        if spec.name not in headers:
            raise PartitionError(f"{where}: no array {spec.name!r} (a model input); it holds "
                                 f"{', '.join(sorted(headers))}")
        shape, dtype = headers[spec.name]
        if spec.dtype != "unknown" and dtype != np.dtype(spec.dtype):
            raise PartitionError(f"{where}: array {spec.name!r} is {dtype}, the model input "
                                 f"is {spec.dtype}")
        _trailing(where, spec.name, shape, list(fixed.get(spec.name, spec.shape)), "input")
    first = plan.outputs[0]
    output_targets = [o.name for o in plan.outputs if o.name in headers
                      and o.name not in {s.name for s in plan.inputs}]
    labels = "labels" in headers and "labels" not in {s.name for s in plan.inputs}
    integer = (np.issubdtype(headers["labels"][1], np.integer) if labels else
               np.issubdtype(headers[first.name][1], np.integer) if first.name in output_targets
               else None)
    kind = "custom" if custom else resolve_loss(loss, first.shape, integer)
    targets: list[str] = []
    if kind in ("cross_entropy", "mse") and not labels and not output_targets:
        why = f"for --loss {kind}" if loss != "auto" else "to train against"
        raise PartitionError(f"{where}: no array 'labels' (nor one named as an output: "
                             f"{', '.join(o.name for o in plan.outputs)}) {why}")
    if kind == "cross_entropy":
        name = "labels" if labels else first.name
        shape, dtype = headers[name]
        if not np.issubdtype(dtype, np.integer):
            raise PartitionError(f"{where}: array {name!r} is {dtype}; cross-entropy takes "
                                 "integer labels")
        _trailing(where, name, shape, list(first.shape)[:-1], f"labels of {first.name!r}")
        targets = [name]
    elif kind in ("mse", "custom"):
        targets = (["labels"] if labels else []) + output_targets
        for name in targets:
            shape, dtype = headers[name]
            out = first if name == "labels" else next(o for o in plan.outputs if o.name == name)
            if kind == "mse" and not np.issubdtype(dtype, np.floating):
                raise PartitionError(f"{where}: array {name!r} is {dtype}; --loss mse takes "
                                     "float targets")
            if kind == "mse":
                _trailing(where, name, shape, list(out.shape), f"target of {out.name!r}")
    used = [s.name for s in plan.inputs] + targets
    counts = {n: headers[n][0][0] if headers[n][0] else 0 for n in used}
    if len(set(counts.values())) > 1:
        raise PartitionError(f"{where}: the arrays disagree on the rows: "
                             f"{', '.join(f'{n} {c}' for n, c in counts.items())}")
    rows = next(iter(counts.values()))
    if rows < per_step:
        raise PartitionError(f"{where}: {rows} rows, fewer than one step's {per_step} "
                             "(batch size x micro-batches)")
    index = rows_read(rows, per_step, steps, shuffle, start)
    for spec in plan.inputs:
        if np.issubdtype(headers[spec.name][1], np.floating):
            _scan(source.array(spec.name), index,
                  lambda a: bool(np.isnan(a).any()),
                  f"{where}: array {spec.name!r} holds NaN in the rows this run reads")
        elif ranges and spec.name in ranges and np.issubdtype(headers[spec.name][1], np.integer):
            size, table = ranges[spec.name]
            _scan(source.array(spec.name), index, functools.partial(_outside, size=size),
                  f"{where}: array {spec.name!r} holds ids outside 0..{size - 1}, the rows of "
                  f"the table it indexes ({table}), in the rows this run reads")
    if kind == "cross_entropy":
        name = targets[0]
        classes = first.shape[-1]
        if isinstance(classes, int):
            _scan(source.array(name), index,
                  lambda a: bool(((a != IGNORE_INDEX) & ((a < 0) | (a >= classes))).any()),
                  f"{where}: array {name!r} holds labels outside the vocabulary "
                  f"0..{classes - 1} (or {IGNORE_INDEX}, ignored)")
    return DataInfo(kind, targets, int(rows))


def _outside(array: np.ndarray, size: int) -> bool:
    """Whether ``array`` holds an id outside ``0 .. size - 1``."""
    return bool(((array < 0) | (array >= size)).any())


def _trailing(where: str, name: str, shape: tuple[int, ...], want: list[Any], what: str
              ) -> None:
    """Refuse an array whose dims after the rows differ from the model's (symbolic ones
    match anything)."""
    got = list(shape[1:])
    rest = want[1:]
    if not shape or len(got) != len(rest) or any(isinstance(w, int) and w != g
                                                  for g, w in zip(got, rest)):
        raise PartitionError(f"{where}: array {name!r} has shape {list(shape)}; the {what} "
                             f"wants [rows, {', '.join(map(str, rest))}]".replace(", ]", "]"))


def _scan(array: np.ndarray, index: np.ndarray | None, bad: Callable[[np.ndarray], bool],
          message: str) -> None:
    """Raise ``message`` when ``bad`` holds for a chunk of ``array``'s rows ``index`` (None:
    all rows), read a chunk at a time."""
    rows = len(array) if index is None else len(index)
    row_bytes = max(int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize, 1)
    chunk = max(CHUNK_BYTES // row_bytes, 1)
    for lo in range(0, rows, chunk):
        part = (np.asarray(array[lo:lo + chunk]) if index is None
                else _take(array, index[lo:lo + chunk]))
        if bad(part):
            raise PartitionError(message)
