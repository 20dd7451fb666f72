"""Training data for the tests of ``train --data``: text as byte tokens, a tiny model that computes
its own loss, and a picklable batch factory and loss function (they travel to the ranks)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = ["OwnLoss", "byte_rows", "factory_batches", "recorded_batches", "twice_the_output"]


def byte_rows(rows: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` x ``seq`` tokens (ASCII bytes of Python source files that ship with Python) and
    their next-token labels; row ``i`` has its first ``i % 4`` labels ignored (-100)."""
    folder = Path(os.__file__).parent
    text = b"".join((folder / name).read_bytes() for name in ("textwrap.py", "shlex.py"))
    tokens = np.frombuffer(text, np.uint8)
    tokens = tokens[tokens < 128].astype(np.int64)
    assert len(tokens) > rows * seq + 1
    ids = tokens[:rows * seq].reshape(rows, seq)
    labels = tokens[1:rows * seq + 1].reshape(rows, seq).copy()
    for i in range(rows):
        labels[i, :i % 4] = -100
    return ids, labels


class OwnLoss(nn.Module):
    """A model that returns its own scalar loss (a mean of squares)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.c(self.b(self.a(x).tanh()).tanh()) ** 2).mean()


def factory_batches(arrays: Mapping[str, np.ndarray], rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Whole-step batches of ``rows`` rows, in order, wrapping (the same in every rank)."""
    total = len(next(iter(arrays.values())))
    start = 0
    while True:
        index = np.arange(start, start + rows) % total
        yield {n: a[index] for n, a in arrays.items()}
        start += rows


def twice_the_output(outputs: Mapping[str, torch.Tensor],
                     targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A user's loss: twice the model's own."""
    return 2 * outputs["loss"]


def recorded_batches(folder: Path, arrays: Mapping[str, np.ndarray], rows: int
                     ) -> Iterator[dict[str, np.ndarray]]:
    """:func:`factory_batches`, leaving a file named after the calling process in ``folder``."""
    (folder / str(os.getpid())).write_text("called")
    return factory_batches(arrays, rows)
