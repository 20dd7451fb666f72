"""The exact CP-SAT solver: hand-checked answers, the relay cost model, and the same optimum
as brute force on random small DAGs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from onnx_partition.errors import PartitionError
from onnx_partition.solve.brute import brute_force
from onnx_partition.solve.ilp import solve_ilp, stage_windows
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.search import split_order

INF = math.inf


def chain4(bandwidth: float = INF, latency: float = 0.0) -> DagProblem:
    """in -> n0 -> n1 -> n2 -> n3 -> out, compute 1, 2, 3, 4; the n2 -> n3 tensor is big."""
    return DagProblem(
        compute_ms=[1.0, 2.0, 3.0, 4.0],
        producer=[-1, 0, 1, 2, 3],
        consumers=[[0], [1], [2], [3], []],
        is_output=[False, False, False, False, True],
        nbytes=[1.0, 1.0, 1.0, 10.0, 1.0],
        bandwidth_bytes_per_ms=bandwidth,
        latency_ms=latency,
    )


def diamond(bandwidth: float = INF, latency: float = 0.0) -> DagProblem:
    """a -> {b, c} -> d with compute 1, 4, 4, 1; a's output (read by b and c) is big."""
    return DagProblem(
        compute_ms=[1.0, 4.0, 4.0, 1.0],
        producer=[-1, 0, 1, 2, 3],
        consumers=[[0], [1, 2], [3], [3], []],
        is_output=[False, False, False, False, True],
        nbytes=[1.0, 10.0, 1.0, 1.0, 1.0],
        bandwidth_bytes_per_ms=bandwidth,
        latency_ms=latency,
    )


# ------------------------------------------------------------------ the cost model


def test_relay_model_by_hand() -> None:
    # Chain n0 -> n1 -> n2. Graph input X (4 B) read by n0 and n2 is relayed from the start;
    # n0's graph output Y (2 B) is relayed to the end; a dead tensor (100 B) crosses nothing;
    # n2's output (8 B) is already in the last stage.
    problem = DagProblem(
        compute_ms=[1.0, 1.0, 1.0],
        producer=[-1, 0, 1, 0, 0, 2],
        consumers=[[0, 2], [1], [2], [], [], []],
        is_output=[False, False, False, True, False, True],
        nbytes=[4.0, 1.0, 1.0, 2.0, 100.0, 8.0],
        bandwidth_bytes_per_ms=1.0,
        latency_ms=0.5,
    )
    assert problem.cross_bytes([0, 1, 2], 3) == [7.0, 7.0]
    assert problem.stage_times([0, 1, 2], 3) == [8.5, 16.0, 8.5]
    assert problem.cross_bytes([0, 0, 1], 2) == [4.0 + 1.0 + 2.0]
    assert problem.stage_times([0, 0, 1], 2) == [2.0 + 7.0 + 0.5, 1.0 + 7.0 + 0.5]
    assert problem.stage_times([0, 0, 0], 1) == [3.0]  # one stage: no boundaries, no latency


def test_free_communication_ignores_bytes_but_not_latency() -> None:
    assert chain4().stage_times([0, 0, 1, 1], 2) == [3.0, 7.0]
    assert chain4(latency=0.25).stage_times([0, 1, 2, 3], 4) == [1.25, 2.5, 3.5, 4.25]


def test_is_valid() -> None:
    problem = diamond()
    assert problem.is_valid([0, 0, 1, 1], 2)
    assert problem.is_valid([0, 1, 2, 3], 4)  # b and c are independent: either order works
    assert problem.is_valid([0, 2, 1, 3], 4)
    assert not problem.is_valid([0, 0, 0, 0], 2)  # an empty stage
    assert not problem.is_valid([1, 0, 1, 1], 2)  # a -> b flows backwards
    assert not problem.is_valid([0, 0, 1], 2)  # wrong length
    assert not problem.is_valid([0, 0, 1, 2], 2)  # stage out of range


def test_bad_problems_are_rejected() -> None:
    with pytest.raises(PartitionError, match="cycle"):
        DagProblem([1.0, 1.0], [0, 1], [[1], [0]], [False, True], [1.0, 1.0])
    with pytest.raises(PartitionError, match="length"):
        DagProblem([1.0], [-1, 0], [[0]], [False, True], [1.0, 1.0])
    with pytest.raises(PartitionError, match="compute_ms"):
        DagProblem([-1.0], [-1], [[0]], [False], [1.0])
    with pytest.raises(PartitionError, match="consumers"):
        DagProblem([1.0], [-1], [[3]], [False], [1.0])
    with pytest.raises(PartitionError, match="bandwidth"):
        DagProblem([1.0], [-1], [[0]], [False], [1.0], bandwidth_bytes_per_ms=0.0)


# ------------------------------------------------------------------ exact answers


@pytest.mark.parametrize(
    ("problem", "stages", "stage_of", "bottleneck"),
    [
        (chain4(), 1, [0, 0, 0, 0], 10.0),
        (chain4(), 2, [0, 0, 0, 1], 6.0),
        (chain4(), 3, [0, 0, 1, 2], 4.0),
        (chain4(), 4, [0, 1, 2, 3], 4.0),
        # Expensive links: never cut the 10-byte n2 -> n3 tensor when there is a choice.
        (chain4(bandwidth=1.0), 2, [0, 0, 1, 1], 8.0),
        (chain4(bandwidth=1.0), 3, [0, 1, 2, 2], 8.0),
        (chain4(bandwidth=1.0), 4, [0, 1, 2, 3], 14.0),
        # Free links: put b and c in different stages. Expensive: keep a's output local.
        (diamond(), 2, None, 5.0),
        (diamond(bandwidth=1.0), 2, [0, 0, 0, 1], 11.0),
        (diamond(latency=0.5), 2, None, 5.5),
        (diamond(), 4, None, 4.0),
    ],
)
def test_exact_answers(
    problem: DagProblem, stages: int, stage_of: list[int] | None, bottleneck: float
) -> None:
    result = solve_ilp(problem, stages, time_limit_s=10.0)
    assert result.optimal
    assert result.gap == 0.0
    assert result.rounding_ms == 0.0  # these costs are exact at the chosen scale
    assert result.bottleneck_ms == bottleneck
    assert result.lower_bound_ms == pytest.approx(bottleneck)
    assert problem.is_valid(result.stage_of, stages)
    if stage_of is not None:
        assert result.stage_of == stage_of
    assert brute_force(problem, stages)[1] == bottleneck


def test_communication_changes_the_optimum() -> None:
    free = solve_ilp(diamond(), 2)
    slow = solve_ilp(diamond(bandwidth=1.0), 2)
    assert sorted(free.stage_of) == [0, 0, 1, 1]  # a with one branch, the other with d
    assert slow.stage_of == [0, 0, 0, 1]
    # The free-comm plan is a poor plan once links cost something, and vice versa.
    assert diamond(bandwidth=1.0).bottleneck_ms(free.stage_of, 2) == 16.0
    assert diamond().bottleneck_ms(slow.stage_of, 2) == 9.0


def test_hint_is_accepted_and_validated() -> None:
    problem = chain4(bandwidth=1.0)
    result = solve_ilp(problem, 2, hint=[0, 0, 1, 1])
    assert result.optimal and result.bottleneck_ms == 8.0
    with pytest.raises(PartitionError, match="hint"):
        solve_ilp(problem, 2, hint=[1, 0, 1, 1])
    with pytest.raises(PartitionError, match="hint"):
        solve_ilp(problem, 2, hint=[0, 1])


@pytest.mark.parametrize("stages", [0, -1, 5])
def test_bad_stage_count(stages: int) -> None:
    with pytest.raises(PartitionError, match="num_stages"):
        solve_ilp(chain4(), stages)
    with pytest.raises(PartitionError, match="num_stages"):
        brute_force(chain4(), stages)


def test_no_solution_in_time_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp_model.CpSolver, "solve", lambda self, model, cb=None: cp_model.UNKNOWN)
    with pytest.raises(PartitionError, match="no feasible 2-stage split within"):
        solve_ilp(chain4(), 2, time_limit_s=1.0)


def test_medium_layered_dag_beats_topological_split() -> None:
    # 24 nodes in 6 layers of 4; each node reads two nodes of the previous layer.
    width, layers = 4, 6
    n = width * layers
    producer = [-1, *range(n)]
    consumers: list[list[int]] = [list(range(width))] + [[] for _ in range(n)]
    for v in range(width, n):
        layer, j = divmod(v, width)
        prev = (layer - 1) * width
        for u in (prev + j, prev + (j + 1) % width):
            consumers[1 + u].append(v)
    is_output = [False] + [i >= n - width for i in range(n)]
    problem = DagProblem(
        compute_ms=[1.0 + (7 * i % 5) for i in range(n)],
        producer=producer,
        consumers=consumers,
        is_output=is_output,
        nbytes=[float(1 + 3 * i % 7) for i in range(n + 1)],
        bandwidth_bytes_per_ms=2.0,
        latency_ms=0.1,
    )
    result = solve_ilp(problem, 3, time_limit_s=10.0)
    assert problem.is_valid(result.stage_of, 3)
    assert result.bottleneck_ms == problem.bottleneck_ms(result.stage_of, 3)
    assert result.bottleneck_ms <= problem.bottleneck_ms(
        split_order(problem, topological_order(problem), 3), 3)
    assert result.lower_bound_ms <= result.bottleneck_ms
    assert 0.0 <= result.gap < 1.0


# ------------------------------------------------------------------ against brute force


@st.composite
def small_dags(draw: st.DrawFn, integral: bool = True) -> DagProblem:
    """Random DAGs of 1-7 nodes: graph inputs read by several nodes, multi-consumer tensors,
    skip connections, graph outputs from any node, and dead tensors."""
    n = draw(st.integers(1, 7))
    producer: list[int] = []
    consumers: list[list[int]] = []
    is_output: list[bool] = []
    makers = [-1] * draw(st.integers(0, 2))
    for v in range(n):
        makers += [v] * draw(st.integers(1, 2))
    for p in makers:
        later = list(range(p + 1, n))
        readers = draw(st.lists(st.sampled_from(later), unique=True, max_size=3)) if later else []
        producer.append(p)
        consumers.append(readers)
        is_output.append(draw(st.booleans()) if readers else draw(st.integers(0, 3)) > 0)
    num_t = len(producer)
    if integral:
        compute = draw(st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n))
        nbytes = draw(st.lists(st.integers(0, 20).map(float), min_size=num_t, max_size=num_t))
    else:
        times = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)
        compute = draw(st.lists(times, min_size=n, max_size=n))
        nbytes = draw(st.lists(times, min_size=num_t, max_size=num_t))
    return DagProblem(
        compute_ms=compute,
        producer=producer,
        consumers=consumers,
        is_output=is_output,
        nbytes=nbytes,
        bandwidth_bytes_per_ms=draw(st.sampled_from([INF, 4.0, 1.0, 0.3])),
        latency_ms=draw(st.sampled_from([0.0, 0.5])),
    )


@settings(max_examples=30, deadline=None)
@given(problem=small_dags(), data=st.data())
def test_ilp_matches_brute_force(problem: DagProblem, data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, min(3, problem.num_nodes)))
    _, optimum = brute_force(problem, stages)
    result = solve_ilp(problem, stages, time_limit_s=20.0)
    assert result.optimal
    assert problem.is_valid(result.stage_of, stages)
    assert result.bottleneck_ms == problem.bottleneck_ms(result.stage_of, stages)
    assert result.bottleneck_ms == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    assert result.lower_bound_ms <= optimum + 1e-9
    assert result.gap == 0.0


@settings(max_examples=15, deadline=None)
@given(problem=small_dags(integral=False), data=st.data())
def test_ilp_within_rounding_of_brute_force_on_float_costs(
    problem: DagProblem, data: st.DataObject
) -> None:
    stages = data.draw(st.integers(1, min(3, problem.num_nodes)))
    _, optimum = brute_force(problem, stages)
    result = solve_ilp(problem, stages, time_limit_s=20.0)
    assert result.optimal
    assert result.bottleneck_ms == problem.bottleneck_ms(result.stage_of, stages)
    assert optimum - 1e-9 <= result.bottleneck_ms <= optimum + 2 * result.rounding_ms + 1e-9
    assert result.lower_bound_ms <= optimum + 1e-9


# ------------------------------------------------------------------ precedence windows

# a (4) feeds b (2) and c (2), which both feed d (4); free transfers
DIAMOND = DagProblem([4.0, 2.0, 2.0, 4.0], [-1, 0, 1, 2, 3], [[0], [1, 2], [3], [3], []],
                     [False, False, False, False, True], [0.0] * 5)


def test_stage_windows_by_hand() -> None:
    # at most 8 per stage: a and its descendants (12) need two stages, so a is in stage 0 or
    # 1; d and its ancestors (12) likewise, so d is in stage 1 or 2; b and c are free
    assert stage_windows(DIAMOND, 3, 8.0) == [(0, 1), (0, 2), (0, 2), (1, 2)]
    # at most 4 per stage: each stage is full, a alone, then b and c, then d
    assert stage_windows(DIAMOND, 3, 4.0) == [(0, 0), (1, 1), (1, 1), (2, 2)]
    # latency 0.5 leaves stage 0 3.5 of 4: a fits nowhere (first > last: no plan)
    late = DagProblem(DIAMOND.compute_ms, DIAMOND.producer, DIAMOND.consumers,
                      DIAMOND.is_output, DIAMOND.nbytes, latency_ms=0.5)
    assert stage_windows(late, 3, 4.0)[0] == (1, -1)
    assert solve_ilp(DIAMOND, 3, hint=[0, 1, 1, 2]).bottleneck_ms == 4.0


@settings(max_examples=30, deadline=None)
@given(problem=small_dags(), data=st.data())
def test_the_optimum_lies_in_its_windows(problem: DagProblem, data: st.DataObject) -> None:
    """Windows at the optimum itself (their tightest) keep a brute-force optimal plan, and
    CP-SAT started from it (so windowed at the optimum) still proves it."""
    stages = data.draw(st.integers(1, min(3, problem.num_nodes)))
    plan, optimum = brute_force(problem, stages)
    windows = stage_windows(problem, stages, optimum)
    assert all(first <= k <= last for k, (first, last) in zip(plan, windows, strict=True))
    result = solve_ilp(problem, stages, time_limit_s=20.0, hint=plan)
    assert result.optimal
    assert result.bottleneck_ms == pytest.approx(optimum, rel=1e-9, abs=1e-9)
