"""solve/contract.py: units merged exactly, cycles closed by a merge merged too, and any plan of
the units is a plan of the nodes with the same stage times that splits no unit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.solve.contract import contract, expand
from onnx_partition.solve.problem import DagProblem


def chain_problem() -> DagProblem:
    """x -> 0 -> t1 -> 1 -> t2 -> 2 -> t3 -> 3 -> y, and 0's t1 also read by 2 (a skip)."""
    return DagProblem(compute_ms=[1.0, 2.0, 3.0, 4.0],
                      producer=[-1, 0, 1, 2, 3],
                      consumers=[[0], [1, 2], [2], [3], []],
                      is_output=[False, False, False, False, True],
                      nbytes=[8.0, 16.0, 32.0, 64.0, 4.0], bandwidth_bytes_per_ms=8.0)


def test_merge_sums_compute_and_hides_inner_tensors() -> None:
    units, members = contract(chain_problem(), ["a", "b", "b", None])
    assert members == [[0], [1, 2], [3]]
    assert units.compute_ms == (1.0, 5.0, 4.0)
    assert units.producer == (-1, 0, 1, 1, 2)
    assert units.consumers == ((0,), (1,), (), (2,), ())  # t2 lives inside unit b
    assert units.nbytes == chain_problem().nbytes


def test_a_merge_closing_a_cycle_takes_the_cycle_in() -> None:
    # 0 and 2 in one unit, 1 between them: 0 -> 1 -> 2 would loop through the unit
    units, members = contract(chain_problem(), ["u", None, "u", None])
    assert members == [[0, 1, 2], [3]]
    assert units.compute_ms == (6.0, 4.0)


def test_labels_must_match_nodes() -> None:
    with pytest.raises(ValueError, match="3 labels for 4 nodes"):
        contract(chain_problem(), ["a", "b", "c"])


@st.composite
def labelled_dags(draw: st.DrawFn) -> tuple[DagProblem, list[int | None], list[int]]:
    n = draw(st.integers(2, 9))
    producer, consumers = [-1], [[0]]
    for i in range(n):
        readers = draw(st.lists(st.integers(i + 1, n - 1), max_size=3, unique=True)) \
            if i < n - 1 else []
        producer.append(i)
        consumers.append(readers)
    problem = DagProblem(
        compute_ms=[draw(st.floats(0, 5)) for _ in range(n)], producer=producer,
        consumers=consumers, is_output=[False] * n + [True],
        nbytes=[draw(st.floats(0, 100)) for _ in range(n + 1)], bandwidth_bytes_per_ms=10.0)
    labels = [draw(st.one_of(st.none(), st.integers(0, 3))) for _ in range(n)]
    cuts = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return problem, labels, cuts


@settings(max_examples=60, deadline=None)
@given(labelled_dags())
def test_unit_plans_are_node_plans(case: tuple[DagProblem, list[int | None], list[int]]) -> None:
    problem, labels, draws = case
    units, members = contract(problem, labels)
    assert sorted(i for m in members for i in m) == list(range(problem.num_nodes))
    for p, cs in zip(units.producer, units.consumers, strict=True):  # numbered topologically
        assert all(p < c for c in cs)
    for i, a in enumerate(labels):  # equal labels always share a unit
        for j, b in enumerate(labels):
            if a is not None and a == b:
                assert any(i in m and j in m for m in members)
    # a monotone assignment of the units (stage never decreases along the unit order)
    stage_of, stage = [], 0
    for d in draws[: units.num_nodes]:
        stage = min(stage + (d == 0), 3)
        stage_of.append(stage)
    stages = max(stage_of) + 1
    if not units.is_valid(stage_of, stages):
        return
    nodes = expand(stage_of, members, problem.num_nodes)
    assert problem.is_valid(nodes, stages)
    assert problem.stage_times(nodes, stages) == pytest.approx(units.stage_times(stage_of, stages))
