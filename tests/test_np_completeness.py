"""docs/np_completeness.md kept honest: its reductions, run through the project's exact solvers.

Every small 3-PARTITION (and PARTITION) instance of a range is built into the fork-join DAG of the
reduction, and the exact solvers' answer (brute force, CP-SAT) must equal the answer of a tiny
brute force over triples. The hybrid statements are checked with the hybrid DP, which is exact
for them on two devices (its replica counts 1..8 then cover every count); a free-depth pipeline
with replicas can run a 3-PARTITION no-instance at period K, as the document's counterexample says.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import pytest

from onnx_partition.errors import PartitionError
from onnx_partition.solve.brute import brute_force
from onnx_partition.solve.dp import split_sequence
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.ilp import solve_ilp
from onnx_partition.solve.problem import DagProblem

Triples = list[tuple[int, int, int]]


def three_partition_instances(m: int, max_k: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every multiset of 3m integers strictly between K/4 and K/2 summing to mK, K <= max_k."""
    for k in range(3, max_k + 1):
        values = [a for a in range(1, k) if k < 4 * a and 2 * a < k]
        for combo in itertools.combinations_with_replacement(values, 3 * m):
            if sum(combo) == m * k:
                yield combo, k


def triples(numbers: Sequence[int], k: int) -> Triples | None:
    """Indices of a 3-partition of ``numbers`` into triples summing to ``k``, or None."""

    def search(left: list[int]) -> Triples | None:
        if not left:
            return []
        first, rest = left[0], left[1:]
        for x, y in itertools.combinations(rest, 2):
            if numbers[first] + numbers[x] + numbers[y] == k:
                tail = search([i for i in rest if i not in (x, y)])
                if tail is not None:
                    return [(first, x, y), *tail]
        return None

    return search(list(range(len(numbers))))


def fork_join(numbers: Sequence[int]) -> DagProblem:
    """The reduction's DAG: fork r (node 0), branch i (node i + 1, compute numbers[i]), join z;
    input x -> r, r -> every branch, every branch -> z, z -> output; sizes 0, B = 1, lambda = 0."""
    branches = len(numbers)
    join = branches + 1
    return DagProblem(
        compute_ms=[0, *numbers, 0],
        producer=[-1, 0, *range(1, branches + 1), join],
        consumers=[[0], list(range(1, branches + 1)), *([[join]] * branches), []],
        is_output=[False] * (branches + 2) + [True],
        nbytes=[0] * (branches + 3),
        bandwidth_bytes_per_ms=1.0,
        latency_ms=0.0,
    )


def proof_split(parts: Triples, branches: int) -> list[int]:
    """The split of the proof's (=>) direction: r with triple 1 in stage 0, triple s in stage
    s - 1, z in the last stage."""
    stage_of = [0] * (branches + 2)
    for s, part in enumerate(parts):
        for i in part:
            stage_of[i + 1] = s
    stage_of[-1] = len(parts) - 1
    return stage_of


def shuffled(numbers: tuple[int, ...]) -> tuple[int, ...]:
    """A fixed interleaving (stride 5 modulo the length), so the node numbering does not line up
    with sorted triples."""
    n = len(numbers)
    stride = 5 if n % 5 else 7
    assert math.gcd(stride, n) == 1  # a permutation
    return tuple(numbers[(stride * i) % n] for i in range(n))


def test_the_instance_generator_and_the_triples_search_on_known_cases() -> None:
    assert list(three_partition_instances(1, 8)) == [((1, 1, 1), 3), ((2, 2, 2), 6),
                                                     ((2, 2, 3), 7)]
    assert triples([4, 4, 5, 4, 4, 5], 13) == [(0, 1, 2), (3, 4, 5)]
    assert triples([4, 4, 4, 4, 4, 6], 13) is None  # the document's counterexample


@pytest.mark.parametrize("m", [1, 2])
def test_brute_force_decides_three_partition_through_the_reduction(m: int) -> None:
    answers = {True: 0, False: 0}
    for numbers, k in three_partition_instances(m, 25):
        numbers = shuffled(numbers)
        problem = fork_join(numbers)
        parts = triples(numbers, k)
        _, best = brute_force(problem, m)
        assert (best <= k) == (parts is not None), (numbers, k, best)
        if parts is not None:  # the proof's split is valid and every stage takes exactly K
            split = proof_split(parts, len(numbers))
            assert problem.is_valid(split, m)
            assert problem.stage_times(split, m) == [float(k)] * m
        answers[parts is not None] += 1
    assert answers[True] >= 40 and (m == 1 or answers[False] >= 30)  # both answers occur


def test_cp_sat_decides_three_partition_through_the_reduction() -> None:
    answers = {True: 0, False: 0}
    for numbers, k in three_partition_instances(3, 19):
        numbers = shuffled(numbers)
        result = solve_ilp(fork_join(numbers), 3, time_limit_s=20.0, workers=1)
        assert result.optimal and result.rounding_ms == 0.0
        assert (result.bottleneck_ms <= k) == (triples(numbers, k) is not None), (numbers, k)
        answers[result.bottleneck_ms <= k] += 1
    assert answers[True] >= 50 and answers[False] >= 15


def test_two_stages_decide_partition() -> None:
    """The S = 2 corollary: the reduction from PARTITION (any positive integers, T = half)."""
    answers = {True: 0, False: 0}
    for size in range(2, 6):
        for numbers in itertools.combinations_with_replacement(range(1, 7), size):
            if sum(numbers) % 2:
                continue
            half = sum(numbers) // 2
            yes = any(sum(numbers[i] for i in subset) == half
                      for r in range(size + 1) for subset in itertools.combinations(range(size), r))
            _, best = brute_force(fork_join(numbers), 2)
            assert (best <= half) == yes, numbers
            answers[yes] += 1
    assert answers[True] >= 50 and answers[False] >= 50


# ------------------------------------------------------------------ hybrid: stages x replicas


def sequence(numbers: Sequence[int], param_bytes: Sequence[float]) -> SequenceCosts:
    """The fork-join DAG in the topological order r, branches in the given order, z."""
    n = len(numbers) + 2
    return SequenceCosts([0.0, *map(float, numbers), 0.0], [0.0] * n,
                         [0.0, *param_bytes, 0.0], [0.0] * n, [0.0] * (n + 1))


def best_period(costs: SequenceCosts, config: HybridConfig) -> float:
    """The hybrid DP's smallest bottleneck period, inf when no plan fits in memory."""
    try:
        plans = plan_hybrid(costs, config)
    except PartitionError:
        return math.inf
    return min(max(s.period_ms for s in plan) for plan in plans)


def dag_best_period(numbers: tuple[int, ...], params: Sequence[float],
                    config: HybridConfig) -> float:
    """The least period over every convex split of the fork-join DAG: each is contiguous in the
    order r, branches sorted by stage, z; equal numbers are interchangeable."""
    return min(best_period(sequence(order, [params[numbers.index(a)] for a in order]), config)
               for order in set(itertools.permutations(numbers)))


def test_free_depth_counterexample() -> None:
    """The document's counterexample: no 3-partition, yet one stage on 2 replicas has period
    26 / 2 = 13 = K, while every 2-stage pipeline takes at least 14."""
    numbers, k = (4, 4, 4, 4, 4, 6), 13
    assert triples(numbers, k) is None
    assert brute_force(fork_join(numbers), 2)[1] == 14.0
    costs = sequence(numbers, [0.0] * 6)
    best = plan_hybrid(costs, HybridConfig(devices=2))[0]
    assert [(s.start, s.end, s.replicas, s.period_ms) for s in best] == [(0, 8, 2, 13.0)]
    fixed = plan_hybrid(costs, HybridConfig(devices=2, depth=2))[0]  # depth S = D: r_s = 1
    assert [s.replicas for s in fixed] == [1, 1] and max(s.period_ms for s in fixed) == 14.0


def test_free_depth_without_memory_or_allreduce_is_one_stage_on_every_device() -> None:
    numbers = (3, 1, 4, 1, 5, 9, 2, 6)
    for devices in (1, 2, 3, 5, 8):
        config = HybridConfig(devices=devices, microbatches=120)  # every D divides M
        best = plan_hybrid(sequence(numbers, [1.0] * 8), config)[0]
        assert [(len(best), best[0].replicas)] == [(1, devices)]
        assert best[0].period_ms == pytest.approx(sum(numbers) / devices)


HARD_CASES = [((4, 4, 4, 4, 4, 6), 13), ((5, 5, 5, 5, 5, 7), 16), ((5, 5, 5, 5, 6, 8), 17),
              ((4, 4, 5, 4, 4, 5), 13), ((5, 5, 6, 5, 5, 6), 16), ((5, 6, 6, 5, 5, 7), 17)]


@pytest.mark.parametrize(("numbers", "k"), HARD_CASES)
def test_fixed_depth_hybrid_with_as_many_devices_as_stages_is_the_pipeline(
    numbers: tuple[int, ...], k: int
) -> None:
    config = HybridConfig(devices=2, depth=2)
    assert dag_best_period(numbers, [0.0] * 6, config) == brute_force(fork_join(numbers), 2)[1]
    plans = plan_hybrid(sequence(numbers, [0.0] * 6), config)
    assert all(s.replicas == 1 for plan in plans for s in plan)
    exact = split_sequence([0.0, *map(float, numbers), 0.0], [0.0] * 9, 2).bottleneck_ms
    assert min(max(s.period_ms for s in plan) for plan in plans) == exact


@pytest.mark.parametrize(("numbers", "k"), HARD_CASES)
def test_free_depth_hybrid_with_memory_decides_three_partition(
    numbers: tuple[int, ...], k: int
) -> None:
    """Theorem 4 (a): parameter bytes a_i, memory K per device, D = m devices."""
    yes = triples(numbers, k) is not None
    period = dag_best_period(numbers, list(map(float, numbers)),
                             HybridConfig(devices=2, memory_bytes=float(k)))
    assert period == (k if yes else math.inf)  # a no-instance has no plan within memory at all


@pytest.mark.parametrize(("numbers", "k"), HARD_CASES)
def test_free_depth_training_with_allreduce_decides_three_partition(
    numbers: tuple[int, ...], k: int
) -> None:
    """Theorem 4 (b): training, unlimited memory, K + 1 parameter bytes per branch, all-reduce
    bandwidth 1, one micro-batch, D = m devices."""
    yes = triples(numbers, k) is not None
    config = HybridConfig(devices=2, train=True, microbatches=1, link_bytes_per_ms=1.0)
    period = dag_best_period(numbers, [k + 1.0] * 6, config)
    assert (period <= k) == yes
    assert period == brute_force(fork_join(numbers), 2)[1]  # replication never pays here
