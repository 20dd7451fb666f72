"""Where a training rank's step went besides compute, read from the rank's own spans
(:class:`~onnx_partition.runtime.train.rank.RankResult` ``spans`` and ``tail``): the engine's
fixed costs that the simulator prices as ``action_ms`` (per action), the step's collectives
(``barrier_ms``) and its tail.

Per rank and steady step (the first step left out: it warms the caches and counts saved bytes):

* **action work**: the wall time of the step's actions outside their compute and outside the
  time blocked in receives, plus the gaps between actions and before the first (receive
  headers, copies of sent tensors, posting sends, stashing, freeing graphs, the batch's slice),
  divided by the number of actions: ``action_ms``;
* **tail**: from the last action to the step's end: sends awaited (``sends_ms``), tied
  gradients summed (``grad_sum_ms``), the gradient norm's all-reduce (``norm_ms``, the first
  barrier: a rank that finishes its actions early waits there for the others), the optimizer
  step (``optimizer_ms``), and the step figures' all-reduce (``closing_ms``, the second
  barrier).

A barrier's own cost (``barrier_ms``) is what the rank arriving last pays: the least over ranks
of each of the two all-reduces, the mean of the two. Pure Python over the results' numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Protocol

__all__ = ["RankOverheads", "SpanSource", "barrier_ms", "rank_overheads"]


class SpanSource(Protocol):
    """What :func:`rank_overheads` reads of a rank's result (``RankResult`` has it)."""

    stage: int
    step_ms: list[float]
    forward_ms: list[float]
    backward_ms: list[float]
    spans: list[list[tuple[str, float, float, float]]]
    tail: list[dict[str, float]]


@dataclass(frozen=True)
class RankOverheads:
    """One rank's steady-step means (ms): its step, compute, time blocked in receives, engine
    work per action (``action_ms``, over ``actions`` actions a step) and the tail's parts."""

    stage: int
    step_ms: float
    compute_ms: float  # forward (with the loss) + backward
    blocked_ms: float
    actions: int
    action_ms: float
    sends_ms: float
    grad_sum_ms: float
    norm_ms: float
    optimizer_ms: float
    closing_ms: float


def rank_overheads(result: SpanSource) -> RankOverheads:
    """The means over ``result``'s steady steps (all steps if only one ran) of where its step
    went (the module docstring)."""
    steps = len(result.step_ms)
    if steps == 0 or len(result.spans) != steps or len(result.tail) != steps:
        raise ValueError("a rank result with one span list and one tail per step is needed")
    keep = range(1, steps) if steps > 1 else range(steps)
    actions = len(result.spans[keep[0]])
    work, blocked, closing = [], [], []
    tails: dict[str, list[float]] = {}
    for i in keep:
        spans = result.spans[i]
        end = spans[-1][2] if spans else 0.0
        compute = result.forward_ms[i] + result.backward_ms[i]
        waited = sum(b for *_, b in spans)
        work.append(max(end - compute - waited, 0.0))
        blocked.append(waited)
        tail = result.tail[i]
        for name, value in tail.items():
            tails.setdefault(name, []).append(value)
        closing.append(max(result.step_ms[i] - end - sum(tail.values()), 0.0))

    def part(name: str) -> float:
        return mean(tails[name]) if name in tails else 0.0

    return RankOverheads(
        stage=result.stage,
        step_ms=mean(result.step_ms[i] for i in keep),
        compute_ms=mean(result.forward_ms[i] + result.backward_ms[i] for i in keep),
        blocked_ms=mean(blocked), actions=actions,
        action_ms=mean(work) / actions if actions else 0.0,
        sends_ms=part("sends_ms"), grad_sum_ms=part("grad_sum_ms"), norm_ms=part("norm_ms"),
        optimizer_ms=part("optimizer_ms"), closing_ms=mean(closing))


def barrier_ms(ranks: Sequence[RankOverheads]) -> float:
    """One of the step's barriers as the engine runs it: the least over ranks of the norm's
    all-reduce and of the closing one (the rank arriving last waits for nobody), the mean of
    the two; 0 without ranks."""
    if not ranks:
        return 0.0
    return (min(r.norm_ms for r in ranks) + min(r.closing_ms for r in ranks)) / 2.0
