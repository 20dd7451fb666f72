"""Where a training rank's step went besides compute, read from the rank's own spans
(:class:`~onnx_partition.runtime.train.rank_io.RankResult` ``spans`` and ``tail``): the engine's
fixed costs that the simulator prices as ``action_ms`` (per action), the step's collectives
(``barrier_ms``) and its tail.

Per rank and timed step (:func:`timed_from`: the first two left out where others follow, as
the memory tracker measures them; else the first, which warms the caches and counts saved
bytes):

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

**The run as the simulator's costs** (:func:`run_costs`, :func:`run_pipeline`): per stage and
micro-batch the run's compute (forward, backward; under ZB-H1 the backward's ``I`` share), the
work per action (added to each action's duration, as plan.json's ``simulator_costs.action_ms``)
and the tail (``optimizer_ms + sends_ms``, the tied gradients' all-reduce at what its last
holder pays, plus 2 barriers, as ``step_ms``). What
that simulation leaves of the measured step is what hops cost while the cores compute beyond an
idle ping-pong's ``send_ms``: :func:`fit_hop_ms` finds that extra per hop by bisection (the
simulator is monotone in ``send_ms``). ``engine.probe`` (:mod:`~onnx_partition.runtime.train.
probe`) and ``profile --plan`` (:mod:`onnx_partition.calibrate.stage_modules`) both read a run so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import mean
from typing import Protocol

from onnx_partition.cost.engine_price import BARRIERS_PER_STEP
from onnx_partition.pipeline.schedules import Schedule
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate

__all__ = ["RankOverheads", "RunCosts", "SpanSource", "barrier_ms", "fit_hop_ms",
           "rank_overheads", "run_costs", "run_pipeline"]

_KIND = re.compile(r"^\d+([FBIW])\d+$")


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


#: The leading steps a rank's memory is measured over (:mod:`onnx_partition.runtime.memtrack`:
#: on CPU its dispatch mode slows every op, gpt tiny's step about 2x). A steady step holds no
#: more than the second: the optimizer's state is made at the first's end.
TRACKED_STEPS = 2


def timed_from(steps: int) -> int:
    """The first of ``steps`` steps a run times: the one after the tracked steps where some
    follow them, else the second (the first warms the caches) where there are several."""
    return TRACKED_STEPS if steps > TRACKED_STEPS else 1 if steps > 1 else 0


def rank_overheads(result: SpanSource) -> RankOverheads:
    """The means over ``result``'s timed steps (:func:`timed_from`) of where its step
    went (the module docstring)."""
    steps = len(result.step_ms)
    if steps == 0 or len(result.spans) != steps or len(result.tail) != steps:
        raise ValueError("a rank result with one span list and one tail per step is needed")
    keep = range(timed_from(steps), steps)
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


@dataclass(frozen=True)
class RunCosts:
    """A training run read as the simulator's costs, per stage (ms, per micro-batch on one
    replica, steady steps): compute (``backward_input_ms``: the backward's ``I`` share under
    ZB-H1, from the ``I`` and ``W`` spans; None otherwise), engine work per action, the tail
    after the last action (optimizer, gradient sums, sends awaited), the barrier and the
    measured step (mean over ranks)."""

    forward_ms: list[float]
    backward_ms: list[float]
    backward_input_ms: list[float] | None
    action_ms: list[float]
    tail_ms: list[float]
    replicas: list[int]
    barrier_ms: float
    measured_ms: float

    def step_ms(self) -> list[float]:
        """Each stage's per-step work: its tail plus the step's two barriers."""
        return [t + BARRIERS_PER_STEP * self.barrier_ms for t in self.tail_ms]


def _input_share(results: Sequence[SpanSource]) -> float:
    """Of the ``I`` and ``W`` actions' time outside receives, the ``I`` share (0.5 with none)."""
    spent = {"I": 0.0, "W": 0.0}
    for result in results:
        for spans in result.spans[timed_from(len(result.spans)):]:
            for name, start, end, blocked in spans:
                found = _KIND.match(name)
                if found and found.group(1) in spent:
                    spent[found.group(1)] += max(end - start - blocked, 0.0)
    total = spent["I"] + spent["W"]
    return spent["I"] / total if total > 0 else 0.5


def _tied_ms(ranks: Sequence[RankOverheads], mine: Sequence[Sequence[int]]) -> list[float]:
    """Per stage, what the all-reduce of tied gradients costs it: the least ``grad_sum_ms``
    over the ranks that ran one (a collective: the holder arriving last waits for nobody, the
    others' figures include their wait for it, which the simulator sees as their idle time),
    0 for a stage whose ranks ran none."""
    ran = [r.grad_sum_ms for r in ranks if r.grad_sum_ms > 0]
    least = min(ran, default=0.0)
    return [least if any(ranks[i].grad_sum_ms > 0 for i in ids) else 0.0 for ids in mine]


def run_costs(results: Sequence[SpanSource], microbatches: int, *, split: bool) -> RunCosts:
    """``results`` (every rank of one run) as :class:`RunCosts`: a stage's compute is the sum
    over its replicas of their steady means over ``microbatches`` (all replicas together ran
    them all); ``action_ms`` and the tail the mean over its replicas; ``split``: a ZB-H1 run
    (``backward_input_ms`` from its spans)."""
    if not results or microbatches < 1:
        raise ValueError("a run's rank results and at least one micro-batch are needed")
    ranks = [rank_overheads(r) for r in results]
    stages = max(r.stage for r in ranks) + 1
    mine = [[i for i, r in enumerate(ranks) if r.stage == k] for k in range(stages)]
    if not all(mine):
        raise ValueError("every stage needs at least one rank's result")

    def steady(values: Sequence[float]) -> float:
        return mean(values[timed_from(len(values)):])

    fwd = [sum(steady(results[i].forward_ms) for i in ids) / microbatches for ids in mine]
    bwd = [sum(steady(results[i].backward_ms) for i in ids) / microbatches for ids in mine]
    share = [_input_share([results[i] for i in ids]) for ids in mine]
    return RunCosts(
        forward_ms=fwd, backward_ms=bwd,
        backward_input_ms=[b * s for b, s in zip(bwd, share, strict=True)] if split else None,
        action_ms=[mean(ranks[i].action_ms for i in ids) for ids in mine],
        tail_ms=[mean(ranks[i].optimizer_ms + tied + ranks[i].sends_ms
                      for i in ids) for ids, tied in zip(mine, _tied_ms(ranks, mine),
                                                         strict=True)],
        replicas=[len(ids) for ids in mine], barrier_ms=barrier_ms(ranks),
        measured_ms=mean(r.step_ms for r in ranks))


def run_pipeline(run: RunCosts, send_ms: Sequence[float], *, hop_ms: float = 0.0
                 ) -> PipelineCosts:
    """The simulator's costs of ``run`` with ``send_ms`` per boundary plus ``hop_ms`` each: each
    stage's ``action_ms`` on every action, its ``step_ms`` its tail and barriers; no
    accumulation or split terms (the run's compute has them)."""
    inputs: Sequence[float | None] = run.backward_input_ms or [None] * len(run.forward_ms)
    stages = [StageCosts(f, b, r, backward_input_ms=i, step_ms=t, action_ms=a)
              for f, b, r, i, t, a in zip(run.forward_ms, run.backward_ms, run.replicas, inputs,
                                          run.step_ms(), run.action_ms, strict=True)]
    return PipelineCosts(stages, [s + hop_ms for s in send_ms])


def fit_hop_ms(schedule: Schedule, costs: PipelineCosts, measured_ms: float, *,
               tolerance_ms: float = 1e-6) -> float:
    """The extra ms per hop ``h >= 0`` that makes ``simulate(schedule, costs)``, with ``h``
    added to every ``send_ms``, last ``measured_ms``: bisection on ``h`` (the iteration never
    shrinks as a send grows), to ``tolerance_ms``; 0 when the costs already reach it or there
    is no hop."""
    def iteration(extra: float) -> float:
        sends = [s + extra for s in costs.send_ms]
        return simulate(schedule, replace(costs, send_ms=sends)).iteration_ms

    if not costs.send_ms or iteration(0.0) >= measured_ms:
        return 0.0
    low, high = 0.0, max(measured_ms, tolerance_ms)
    while iteration(high) < measured_ms:  # every pipeline's path crosses a hop: few doublings
        low, high = high, 2.0 * high
    while high - low > tolerance_ms:
        middle = (low + high) / 2.0
        if iteration(middle) < measured_ms:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0
