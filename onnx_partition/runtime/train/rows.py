"""A step's rows, taken a micro-batch at a time (issue 33): a rank holds only the micro-batches
its actions need, never the step's ``B x M`` rows.

A :class:`StepRows` is the step's tensors by name (a ``Mapping``) that makes or reads rows only
when asked: :meth:`StepRows.microbatch` gives micro-batch ``m``'s rows (the one split rule,
:func:`~onnx_partition.pipeline.microbatch.row_ranges`), :attr:`StepRows.rows` and
:meth:`StepRows.shapes` what the step holds without reading it. Reading a name whole
(``batch[name]``: the single-process reference, torch's pipelining engine) makes every row once
and keeps them. :func:`~onnx_partition.pipeline.microbatch.rows_of` takes a ``StepRows``'s
micro-batch from it, so every caller that cuts a batch (the ranks' forwards, the loss's
micro-batch weights) reads only the rows it cuts.

Two kinds: the rows of ``--data`` arrays (:class:`~onnx_partition.runtime.train.data.
ArrayBatches`; a memory map reads only the rows taken) and synthetic rows
(:func:`synthetic_rows`), each row drawn from its own generator, seeded by ``(seed, step,
row)``: any split of the step into micro-batches, in any process, draws the same rows (the
pipeline's ranks and the single-process reference of ``--check`` alike).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from onnx_partition.pipeline.microbatch import row_ranges

__all__ = ["StepRows", "batch_rows", "batch_shapes", "row_seed", "synthetic_rows"]

Tensors = dict[str, torch.Tensor]
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
MakeBatch = Callable[[int, torch.Generator], tuple[Tensors, Tensors]]


class StepRows(Mapping[str, torch.Tensor]):
    """A step's ``rows`` rows of ``names``, made or read a range at a time by ``take(lo, hi,
    names)``; ``shapes`` (each name's shape, ``rows`` first, and dtype) known without reading."""

    def __init__(self, names: Iterable[str], rows: int,
                 take: Callable[[int, int, Sequence[str]], Tensors],
                 shapes: Callable[[], Shapes]) -> None:
        self._names, self.rows = list(names), rows
        self._take, self._shapes = take, shapes
        self._whole: Tensors = {}

    def microbatch(self, m: int, count: int, names: Iterable[str] | None = None) -> Tensors:
        """Micro-batch ``m`` of ``count``'s rows of ``names`` (all when None)."""
        wanted = self._names if names is None else list(names)
        missing = [n for n in wanted if n not in self._names]
        if missing:
            raise KeyError(missing[0])
        lo, hi = row_ranges(self.rows, count)[m]
        return self._take(lo, hi, wanted)

    def shapes(self) -> Shapes:
        return self._shapes()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._whole:  # every row, once (a caller that wants the whole step)
            self._whole.update(self._take(0, self.rows, [n for n in self._names
                                                         if n not in self._whole]))
        return self._whole[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def batch_rows(batch: Mapping[str, torch.Tensor]) -> int:
    """The rows of a step's batch (a :class:`StepRows` or tensors), read from no row; 0 for
    none."""
    if isinstance(batch, StepRows):
        return batch.rows
    return next((int(t.shape[0]) for t in batch.values() if t.dim()), 0)


def batch_shapes(batch: Mapping[str, torch.Tensor]) -> Shapes:
    """Each tensor's shape and dtype (a :class:`StepRows`'s without reading a row)."""
    if isinstance(batch, StepRows):
        return batch.shapes()
    return {n: (tuple(t.shape), t.dtype) for n, t in batch.items()}


def row_seed(seed: int, step: int, row: int) -> int:
    """The seed of synthetic row ``row`` of step ``step`` (a SeedSequence hash of the three:
    distinct triples draw unrelated rows, a validation seed's never a training row)."""
    return int(np.random.SeedSequence([seed, step, row]).generate_state(1, np.uint64)[0])


class _Synthetic:
    """Synthetic rows of one step: row ``r`` is ``make_batch(1, generator)`` seeded by
    :func:`row_seed`."""

    def __init__(self, make_batch: MakeBatch, rows: int, seed: int, step: int) -> None:
        self.make_batch, self.rows, self.seed, self.step = make_batch, rows, seed, step
        self._one: tuple[Tensors, Tensors] | None = None

    def row(self, r: int) -> tuple[Tensors, Tensors]:
        return self.make_batch(1, torch.Generator().manual_seed(row_seed(self.seed, self.step,
                                                                         r)))

    def first(self) -> tuple[Tensors, Tensors]:
        if self._one is None:
            self._one = self.row(0)
        return self._one

    def take(self, side: int, lo: int, hi: int, names: Sequence[str]) -> Tensors:
        """Rows ``lo .. hi`` of ``names`` of the inputs (``side`` 0) or the targets (1)."""
        if not names:
            return {}
        parts = [self.row(r)[side] for r in range(lo, hi)]
        return {n: torch.cat([p[n] for p in parts]) if parts[0][n].dim() else parts[0][n]
                for n in names}

    def shapes(self, side: int) -> Shapes:
        return {n: ((self.rows, *t.shape[1:]) if t.dim() else (), t.dtype)
                for n, t in self.first()[side].items()}

    def side(self, side: int) -> StepRows:
        return StepRows(self.first()[side], self.rows,
                        lambda lo, hi, names: self.take(side, lo, hi, names),
                        lambda: self.shapes(side))


def synthetic_rows(make_batch: MakeBatch, rows: int, seed: int, step: int
                   ) -> tuple[StepRows, StepRows]:
    """Step ``step``'s synthetic batch of ``rows`` rows (inputs, targets), each row drawn when
    a micro-batch that holds it is taken (the module docstring)."""
    source = _Synthetic(make_batch, rows, seed, step)
    return source.side(0), source.side(1)
