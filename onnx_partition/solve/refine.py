"""Local search on a stage assignment of the DAG itself (not of a sequence).

A DP over one sequence only reaches splits that are contiguous in that sequence. Moving a node on
a stage's frontier to the neighbouring stage (a node whose producers all lie in earlier stages may
move back; one whose consumers all lie in later stages may move forward) keeps every edge pointing
forward and reaches any convex split. Starting from the DP's answer, this greedy descent moves one
frontier node of the slowest stage at a time while that lowers (bottleneck, sum of squared stage
times) lexicographically, in the spirit of Kernighan and Lin (1970) moves across one boundary.

The cost model is the relay model of :class:`~onnx_partition.solve.problem.DagProblem`, updated
incrementally: a move changes only the spans of the tensors the node makes or reads, and the
frontier only at the node and its neighbours, so a candidate move is priced without being made
(:meth:`_State.peek`) in time proportional to the node's degree, not to its stage's size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnx_partition.solve.problem import DagProblem

__all__ = ["refine"]


class _State:
    """Assignment, per-stage compute, per-tensor span (first, last stage) and per-boundary
    bytes, updated move by move; and each stage's frontier (the nodes :meth:`can_move` allows
    out of it, back and forward), re-judged at the moved node and its neighbours only."""

    def __init__(self, problem: DagProblem, stage_of: Sequence[int], num_stages: int) -> None:
        self.p = problem
        self.s = num_stages
        self.stage_of = list(stage_of)
        self.reads, self.makes = problem.read_by, problem.made_by
        self.members: list[set[int]] = [set() for _ in range(num_stages)]
        self.compute = [0.0] * num_stages
        for v, k in enumerate(self.stage_of):
            self.members[k].add(v)
            self.compute[k] += problem.compute_ms[v]
        self.cross = [0.0] * max(0, num_stages - 1)
        self.span = [self._span(t) for t in range(problem.num_tensors)]
        for t in range(problem.num_tensors):
            self._add(t, +1)
        self.per_byte = 1.0 / problem.bandwidth_bytes_per_ms
        n = problem.num_nodes
        self.preds = [[problem.producer[t] for t in self.reads[v] if problem.producer[t] >= 0]
                      for v in range(n)]
        self.succs = [[c for t in self.makes[v] for c in problem.consumers[t]]
                      for v in range(n)]
        self.near = [sorted({*self.preds[v], *self.succs[v]}) for v in range(n)]
        self.touched = [sorted({*self.makes[v], *self.reads[v]}) for v in range(n)]
        # nodes of each stage that may move back (index 0) and forward (index 1)
        self.frontier: list[tuple[set[int], set[int]]] = [(set(), set())
                                                          for _ in range(num_stages)]
        for v in range(n):
            self._classify(v)

    def _classify(self, v: int) -> None:
        """Put ``v`` in its stage's frontier sets as :meth:`can_move` says (every producer
        earlier: back; every consumer later: forward), or take it out."""
        k, stage = self.stage_of[v], self.stage_of
        back, forward = self.frontier[k]
        if all(stage[u] < k for u in self.preds[v]):
            back.add(v)
        else:
            back.discard(v)
        if all(stage[c] > k for c in self.succs[v]):
            forward.add(v)
        else:
            forward.discard(v)

    def _span(self, t: int) -> tuple[int, int]:
        p = self.p
        first = self.stage_of[p.producer[t]] if p.producer[t] >= 0 else 0
        stages = [self.stage_of[c] for c in p.consumers[t]]
        if p.is_output[t]:
            stages.append(self.s - 1)
        return first, max(stages, default=-1)

    def _add(self, t: int, sign: int) -> None:
        first, last = self.span[t]
        nbytes = self.p.nbytes[t]
        if last > first and nbytes:
            step, cross = sign * nbytes, self.cross
            for b in range(first, last):
                cross[b] += step

    def move(self, v: int, to: int) -> None:
        touched = self.touched[v]
        for t in touched:
            self._add(t, -1)
        k = self.stage_of[v]
        self.compute[k] -= self.p.compute_ms[v]
        self.compute[to] += self.p.compute_ms[v]
        self.members[k].remove(v)
        self.members[to].add(v)
        self.frontier[k][0].discard(v)
        self.frontier[k][1].discard(v)
        self.stage_of[v] = to
        for t in touched:
            self.span[t] = self._span(t)
            self._add(t, +1)
        self._classify(v)
        for u in self.near[v]:
            self._classify(u)

    def times(self) -> list[float]:
        """Each stage's time: compute plus the sends over both its boundaries."""
        return self._times(self.compute, self.cross)

    def _times(self, compute: list[float], cross: list[float]) -> list[float]:
        times = list(compute)
        if self.s > 1:
            comm = [max(c, 0.0) * self.per_byte + self.p.latency_ms for c in cross]
            for b, c in enumerate(comm):
                times[b] += c
                times[b + 1] += c
        return times

    def peek(self, v: int, to: int) -> list[float]:
        """:meth:`times` as they would be after ``move(v, to)``; the state is left as it is.
        Only the tensors whose span the move changes are re-counted."""
        k, p = self.stage_of[v], self.p
        cross = self.cross
        for t in self.touched[v]:
            nbytes = p.nbytes[t]
            old = self.span[t]
            if p.producer[t] == v:
                new = (to, old[1])
            elif to > old[1] or k < old[1]:  # v reads t: its last reader moves on, or not v
                new = (old[0], max(old[1], to))
            else:  # v was the last to read t, and moves back: who is last now?
                self.stage_of[v] = to
                new = self._span(t)
                self.stage_of[v] = k
            if old != new and nbytes:
                if cross is self.cross:
                    cross = list(cross)
                for b in range(old[0], old[1]):
                    cross[b] -= nbytes
                for b in range(new[0], new[1]):
                    cross[b] += nbytes
        compute = list(self.compute)
        compute[k] -= self.p.compute_ms[v]
        compute[to] += self.p.compute_ms[v]
        return self._times(compute, cross)

    def can_move(self, v: int, to: int) -> bool:
        """The definition the frontier sets keep: ``v`` leaves a stage of two or more nodes
        for ``to``, every edge still pointing forward."""
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

    def movable(self, k: int, to: int) -> list[int]:
        """Stage ``k``'s nodes that may move to its neighbour ``to``, ascending, as the state
        is now (a caller may move nodes while it walks them, as long as it puts them back)."""
        if len(self.members[k]) <= 1:
            return []
        return sorted(self.frontier[k][0 if to == k - 1 else 1])


def _score(times: list[float]) -> tuple[float, float]:
    return max(times), sum(t * t for t in times)


def _better(score: tuple[float, float], best: tuple[float, float], eps: float) -> bool:
    """Lexicographically lower (bottleneck, sum of squared stage times)."""
    return score[0] < best[0] - eps or (score[0] <= best[0] + eps and score[1] < best[1] - eps)


def _best_single(state: _State, best: tuple[float, float], eps: float
                 ) -> tuple[tuple[float, float], int, int] | None:
    """The best improving single frontier move out of any stage, slowest stages first."""
    times = state.times()
    for k in np.argsort(-np.asarray(times)).tolist():
        choice: tuple[tuple[float, float], int, int] | None = None
        for to in state.neighbours(k):
            for v in state.movable(k, to):
                score = _score(state.peek(v, to))
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
    k = times.index(max(times))
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
        left = state.peek(u, to)[stage]
        if left <= target and (fits is None or left > fits[0]):
            fits = (left, u)
        if most is None or left < most[0]:
            most = (left, u)
    chosen = fits or most
    return None if chosen is None else chosen[1]


def _swap(state: _State, best: tuple[float, float], eps: float) -> bool:
    """Exchange a frontier node of the slowest stage with one of a neighbour's, both moving
    across their shared boundary; applied (and True returned) only if it improves the score."""
    times = state.times()
    k = times.index(max(times))
    for other in state.neighbours(k):
        for v in state.movable(k, other):
            state.move(v, other)
            for u in state.movable(other, k):
                if u == v:
                    continue
                if _better(_score(state.peek(u, k)), best, eps):
                    state.move(u, k)
                    return True
            state.move(v, k)
    return False


def refine(
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
