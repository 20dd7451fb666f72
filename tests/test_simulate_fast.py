"""The planner's scorer (:func:`simulate_schedule`) against the event simulator: every figure
equal, bit for bit, on random stage times, replicas, micro-batches, links and schedules."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.pipeline.schedules import ScheduleError, build, stage_orders
from onnx_partition.pipeline.simulate import (
    PipelineCosts,
    SimResult,
    StageCosts,
    simulate,
    simulate_schedule,
)

times = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)
small = st.one_of(st.just(0.0), st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False))


@st.composite
def stage(draw: st.DrawFn, replicas: int) -> StageCosts:
    """One stage with every cost the simulator reads, some zero, some not."""
    backward = draw(times)
    return StageCosts(
        draw(times), backward, replicas, allreduce_ms=draw(small),
        activation_bytes=draw(times), static_bytes=draw(times),
        backward_input_ms=draw(st.one_of(st.none(), st.floats(0.0, backward + 1.0))),
        recompute=draw(st.booleans()), input_bytes=draw(times), step_ms=draw(small),
        accumulate_ms=draw(small), split_ms=draw(small), action_ms=draw(small),
        kept_bytes=draw(small))


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[str, list[int], int, PipelineCosts]:
    """(schedule, replicas, micro-batches, costs), no stage with more replicas than M."""
    m = draw(st.integers(1, 64))
    p = draw(st.integers(1, 5))
    replicas = draw(st.lists(st.integers(1, min(4, m)), min_size=p, max_size=p))
    name = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "infer"]))
    stages = [draw(stage(r)) for r in replicas]
    sends = draw(st.lists(times, min_size=p - 1, max_size=p - 1))
    return name, replicas, m, PipelineCosts(stages, sends)


def full(name: str, replicas: list[int], m: int, costs: PipelineCosts) -> SimResult:
    """The event simulation of the built schedule, its timeline dropped."""
    return replace(simulate(build(name, replicas, m), costs), timeline=[])


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_scorer_equals_the_event_simulation(case: tuple[str, list[int], int, PipelineCosts]
                                            ) -> None:
    name, replicas, m, costs = case
    fast = simulate_schedule(name, replicas, m, costs)
    want = full(name, replicas, m, costs)
    # every field: iteration, throughput, bubble, busy, peak in flight, peak memory, all-reduce
    assert fast == want
    assert fast.timeline == []


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.data())
def test_interleaved_goes_to_the_event_simulation(p: int, reps: int, data: st.DataObject
                                                  ) -> None:
    """Interleaved (DEFAULT_CHUNKS = 2 stages per device): the event simulation's figures."""
    m = p * reps * data.draw(st.integers(1, 3))
    stages = [data.draw(stage(reps)) for _ in range(2 * p)]
    costs = PipelineCosts(stages, data.draw(st.lists(times, min_size=2 * p - 1,
                                                     max_size=2 * p - 1)))
    replicas = [reps] * 2 * p
    assert stage_orders("interleaved", replicas, m) is None
    assert simulate_schedule("interleaved", replicas, m, costs) == replace(
        simulate(build("interleaved", replicas, m), costs), timeline=[])


def test_one_f_one_b_exact_on_equal_stages() -> None:
    """(m + p - 1)(F + B) on p equal stages without sends: 3 stages, 4 micro-batches, F 1,
    B 2 -> 18 ms, bubble 2/6; peak in flight 3, 2, 1."""
    costs = PipelineCosts([StageCosts(1.0, 2.0, activation_bytes=1.0)] * 3, [0.0, 0.0])
    got = simulate_schedule("1f1b", [1, 1, 1], 4, costs)
    assert got.iteration_ms == 18.0
    assert got.bubble_fraction == pytest.approx(2 / 6)
    assert got.peak_inflight == {(0, 0): 3, (1, 0): 2, (2, 0): 1}
    assert got.peak_memory_bytes == {(0, 0): 3.0, (1, 0): 2.0, (2, 0): 1.0}


def test_replicas_must_match_the_costs() -> None:
    costs = PipelineCosts([StageCosts(1.0, 2.0, replicas=2)], [])
    with pytest.raises(ScheduleError, match="devices"):
        simulate_schedule("1f1b", [1], 4, costs)
    with pytest.raises(ScheduleError, match="send_ms"):
        simulate_schedule("1f1b", [2], 4, PipelineCosts(costs.stages, [1.0]))
    with pytest.raises(ScheduleError, match="unknown schedule"):
        simulate_schedule("2f2b", [2], 4, costs)


@pytest.mark.parametrize("name", ["INFER", "1F1B", "ZB-H1"])
def test_names_are_read_as_build_reads_them(name: str) -> None:
    """Case ignored, as :func:`build` ignores it: ``INFER`` plays forwards only."""
    costs = PipelineCosts([StageCosts(1.0, 2.0, 2, allreduce_ms=1.0, activation_bytes=3.0,
                                      step_ms=0.5)] * 2, [0.25])
    assert simulate_schedule(name, [2, 2], 6, costs) == full(name, [2, 2], 6, costs)
