"""The local search of :mod:`onnx_partition.solve.refine` as it was written before it kept its
frontier and stage sums incrementally (issue 36): every candidate move made on the state and
undone, every frontier check walking the stage. A reference for differential tests: on whole
numbers (exact float sums) the incremental search must choose the very same moves."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from onnx_partition.solve.problem import DagProblem

__all__ = ["reference_refine"]


class _State:
    """Assignment, per-stage compute and per-boundary bytes, updated move by move."""

    def __init__(self, problem: DagProblem, stage_of: Sequence[int], num_stages: int) -> None:
        self.p = problem
        self.s = num_stages
        self.stage_of = list(stage_of)
        self.reads, self.makes = problem.read_by, problem.made_by
        self.members: list[set[int]] = [set() for _ in range(num_stages)]
        self.compute = np.zeros(num_stages)
        for v, k in enumerate(self.stage_of):
            self.members[k].add(v)
            self.compute[k] += problem.compute_ms[v]
        self.cross = np.zeros(max(0, num_stages - 1))
        for t in range(problem.num_tensors):
            self._add(t, +1)
        self.per_byte = 1.0 / problem.bandwidth_bytes_per_ms

    def _span(self, t: int) -> tuple[int, int]:
        p = self.p
        first = self.stage_of[p.producer[t]] if p.producer[t] >= 0 else 0
        stages = [self.stage_of[c] for c in p.consumers[t]]
        if p.is_output[t]:
            stages.append(self.s - 1)
        return first, max(stages, default=-1)

    def _add(self, t: int, sign: int) -> None:
        first, last = self._span(t)
        if last > first and self.p.nbytes[t]:
            self.cross[first:last] += sign * self.p.nbytes[t]

    def move(self, v: int, to: int) -> None:
        touched = set(self.makes[v]) | set(self.reads[v])
        for t in touched:
            self._add(t, -1)
        k = self.stage_of[v]
        self.compute[k] -= self.p.compute_ms[v]
        self.compute[to] += self.p.compute_ms[v]
        self.members[k].remove(v)
        self.members[to].add(v)
        self.stage_of[v] = to
        for t in touched:
            self._add(t, +1)

    def times(self) -> np.ndarray:
        times = self.compute.copy()
        if self.s > 1:
            comm = np.maximum(self.cross, 0.0) * self.per_byte + self.p.latency_ms
            times[:-1] += comm
            times[1:] += comm
        return times

    def can_move(self, v: int, to: int) -> bool:
        k = self.stage_of[v]
        if len(self.members[k]) <= 1:
            return False
        p = self.p
        if to == k - 1:  # every producer of v's inputs already at or before `to`
            return all(p.producer[t] < 0 or self.stage_of[p.producer[t]] <= to
                       for t in self.reads[v])
        return all(self.stage_of[c] >= to for t in self.makes[v] for c in p.consumers[t])

    def neighbours(self, k: int) -> list[int]:
        """The stages next to stage ``k``."""
        return [to for to in (k - 1, k + 1) if 0 <= to < self.s]

    def movable(self, k: int, to: int) -> Iterator[int]:
        """Stage ``k``'s nodes that may move to its neighbour ``to`` (checked as each is
        reached: a caller may move nodes in between, as long as it puts them back)."""
        return (v for v in sorted(self.members[k]) if self.can_move(v, to))


def _score(times: np.ndarray) -> tuple[float, float]:
    return float(times.max()), float(np.dot(times, times))


def _better(score: tuple[float, float], best: tuple[float, float], eps: float) -> bool:
    """Lexicographically lower (bottleneck, sum of squared stage times)."""
    return score[0] < best[0] - eps or (score[0] <= best[0] + eps and score[1] < best[1] - eps)


def _best_single(state: _State, best: tuple[float, float], eps: float
                 ) -> tuple[tuple[float, float], int, int] | None:
    """The best improving single frontier move out of any stage, slowest stages first."""
    times = state.times()
    for k in np.argsort(-times).tolist():
        choice: tuple[tuple[float, float], int, int] | None = None
        for to in state.neighbours(k):
            for v in state.movable(k, to):
                state.move(v, to)
                score = _score(state.times())
                state.move(v, k)
                if _better(score, best, eps) and (choice is None or score < choice[0]):
                    choice = (score, v, to)
        if choice is not None:
            return choice
    return None


def _chain(state: _State, best: tuple[float, float], eps: float, *, max_len: int = 64) -> bool:
    """An ejection chain (Glover 1996): move a frontier node out of the slowest stage, and while
    a stage is now slower than the old bottleneck, push its frontier nodes on in the same
    direction. Applied (and True returned) only if the whole chain improves the score."""
    times = state.times()
    k = int(np.argmax(times))
    target = best[0] - eps
    for to in state.neighbours(k):
        step = to - k
        for v in state.movable(k, to):
            done = [(v, k)]
            state.move(v, k + step)
            at = k + step
            while len(done) < max_len:
                if state.times()[at] <= target:
                    break
                pushed = _push(state, at, at + step, target) if 0 <= at + step < state.s else None
                if pushed is None:
                    break
                done.append((pushed, at))
                state.move(pushed, at + step)
                if state.times()[at] <= target:
                    at += step
            if _better(_score(state.times()), best, eps):
                return True
            for node, home in reversed(done):
                state.move(node, home)
    return False


def _push(state: _State, stage: int, to: int, target: float) -> int | None:
    """The frontier node of ``stage`` to move to ``to``: the lightest that brings ``stage`` under
    ``target``, else the one that relieves it most."""
    fits: tuple[float, int] | None = None
    most: tuple[float, int] | None = None
    for u in state.movable(stage, to):
        state.move(u, to)
        left = float(state.times()[stage])
        state.move(u, stage)
        if left <= target and (fits is None or left > fits[0]):
            fits = (left, u)
        if most is None or left < most[0]:
            most = (left, u)
    chosen = fits or most
    return None if chosen is None else chosen[1]


def _swap(state: _State, best: tuple[float, float], eps: float) -> bool:
    """Exchange a frontier node of the slowest stage with one of a neighbour's, both moving
    across their shared boundary; applied (and True returned) only if it improves the score."""
    k = int(np.argmax(state.times()))
    for other in state.neighbours(k):
        for v in state.movable(k, other):
            state.move(v, other)
            for u in state.movable(other, k):
                if u == v:
                    continue
                state.move(u, k)
                if _better(_score(state.times()), best, eps):
                    return True
                state.move(u, other)
            state.move(v, k)
    return False


def reference_refine(
    problem: DagProblem,
    stage_of: Sequence[int],
    num_stages: int,
    *,
    max_moves: int = 10_000,
) -> list[int]:
    """A convex assignment no worse than ``stage_of``: greedy frontier moves, then ejection
    chains, then swaps across a boundary when no single move helps (see module doc)."""
    if num_stages < 2:
        return list(stage_of)
    state = _State(problem, stage_of, num_stages)
    best = _score(state.times())
    eps = 1e-12 * max(1.0, best[0])
    for _ in range(max_moves):
        choice = _best_single(state, best, eps)
        if choice is not None:
            state.move(choice[1], choice[2])
        elif not _chain(state, best, eps) and not _swap(state, best, eps):
            break
        best = _score(state.times())
    return state.stage_of
