"""A rank's result made by hand: the fields of ``RankResult`` that
:mod:`onnx_partition.runtime.train.overheads` reads (``SpanSource``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Result:
    stage: int
    step_ms: list[float]
    forward_ms: list[float]
    backward_ms: list[float]
    spans: list[list[tuple[str, float, float, float]]]
    tail: list[dict[str, float]] = field(default_factory=list)
