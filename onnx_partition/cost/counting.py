"""What the analytic cost models count with: plain shapes, an element count, and the FLOPs
charged per transcendental function evaluation (:mod:`.op_counts` for ONNX operators,
:mod:`.aten_backward` for an aten op's backward)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral

__all__ = ["TRANSCENDENTAL_FLOPS", "Shape", "known_shape", "numel"]

Shape = tuple[int, ...]

TRANSCENDENTAL_FLOPS = 4.0  # FLOPs charged per transcendental function evaluation


def known_shape(shapes: Sequence[Shape | None], i: int) -> Shape | None:
    """Shape i as plain ints, or None if absent, unknown, or holding a negative/symbolic dim."""
    s = shapes[i] if 0 <= i < len(shapes) else None
    if s is None or not all(isinstance(d, Integral) and d >= 0 for d in s):
        return None
    return tuple(int(d) for d in s)


def numel(shape: Shape | None) -> int:
    return math.prod(shape) if shape is not None else 0
