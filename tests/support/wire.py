"""Wires for tests that need no process group."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from onnx_partition.runtime.wire import Wire


class CapturedWire(Wire):
    """A Wire whose sends are kept instead of posted (the messages, in order)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.sent: list[np.ndarray] = []

    def _isend(self, array: np.ndarray, dst: int, pending: list[Any]) -> None:
        self.sent.append(array.copy())
