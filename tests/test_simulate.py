"""Exact answers for the pipeline schedules and event simulator."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.errors import PartitionError
from onnx_partition.simulate import (
    Action,
    Kind,
    PipelineCosts,
    Schedule,
    ScheduleError,
    StageCosts,
    bubble_closed_form,
    gpipe,
    inference,
    one_f_one_b,
    pipeline_time_closed_form,
    render,
    simulate,
    validate,
)
from onnx_partition.solve.planner import lower_bound_ms

F, B = 1.0, 2.0


def costs(
    p: int, replicas: list[int] | None = None, send: float = 0.0, **extra: float
) -> PipelineCosts:
    """Stages of forward F and backward B; a stage of d replicas costs d times as much."""
    reps = replicas or [1] * p
    return PipelineCosts(
        [StageCosts(F * d, B * d, replicas=d, **extra) for d in reps], [send] * (p - 1)
    )


def test_action_str_and_parse_round_trip() -> None:
    a = Action(1, Kind.F, 0)
    assert str(a) == "1F0"
    assert Action.parse("1B3") == Action(1, Kind.B, 3)
    for text in ("0F0", "12B345", "3F17"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("1X0")


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
@pytest.mark.parametrize(
    ("p", "m"), [(1, 1), (1, 5), (2, 1), (2, 4), (3, 2), (4, 4), (4, 9), (5, 3), (6, 16)]
)
def test_equal_stages_match_closed_form(builder: object, p: int, m: int) -> None:
    assert callable(builder)
    r = simulate(builder(p, m), costs(p))
    assert r.iteration_ms == pytest.approx(pipeline_time_closed_form(F + B, p, m))
    assert r.iteration_ms == pytest.approx((m + p - 1) * (F + B))
    assert r.bubble_fraction == pytest.approx(bubble_closed_form(p, m))
    assert r.throughput_per_s == pytest.approx(m / r.iteration_ms * 1000)
    assert all(v == pytest.approx(m * (F + B)) for v in r.busy_ms.values())


@pytest.mark.parametrize(("p", "m"), [(4, 2), (4, 4), (4, 8), (3, 1), (5, 12)])
def test_peak_inflight_and_memory(p: int, m: int) -> None:
    c = costs(p, activation_bytes=10.0, static_bytes=1000.0)
    r = simulate(one_f_one_b(p, m), c)
    assert r.peak_inflight == {(s, 0): min(p - s, m) for s in range(p)}
    assert r.peak_memory_bytes == {(s, 0): 1000.0 + 10.0 * min(p - s, m) for s in range(p)}
    g = simulate(gpipe(p, m), c)
    assert g.peak_inflight == {(s, 0): m for s in range(p)}
    i = simulate(inference(p, m), c)
    assert i.peak_inflight == {(s, 0): 0 for s in range(p)}
    assert i.peak_memory_bytes == {(s, 0): 1010.0 for s in range(p)}


def test_inference_with_slow_stage_is_bound_by_it() -> None:
    fwd = [1.0, 4.0, 2.0, 1.5]
    c = PipelineCosts([StageCosts(f, 0.0) for f in fwd], [0.0] * 3)
    for m in (1, 5, 50):
        r = simulate(inference(4, m), c)
        assert r.iteration_ms == pytest.approx(sum(fwd) + (m - 1) * max(fwd))
    big = simulate(inference(4, 4000), c)
    assert big.throughput_per_s == pytest.approx(1000.0 / max(fwd), rel=1e-3)


def test_communication_adds_latency() -> None:
    fwd, send = [1.0, 3.0, 2.0], [0.5, 0.25]
    c = PipelineCosts([StageCosts(f, 2 * f) for f in fwd], send)
    for m in (1, 7):  # sends overlap compute: pure latency on the forward path
        r = simulate(inference(3, m), c)
        assert r.iteration_ms == pytest.approx(sum(fwd) + sum(send) + (m - 1) * max(fwd))
    one = simulate(one_f_one_b(3, 1), c)  # a single micro-batch goes there and back
    assert one.iteration_ms == pytest.approx(3 * sum(fwd) + 2 * sum(send))
    for builder in (gpipe, one_f_one_b):
        assert (
            simulate(builder(3, 8), costs(3, send=0.5)).iteration_ms
            > simulate(builder(3, 8), costs(3)).iteration_ms
        )


def test_allreduce_is_charged_at_the_end() -> None:
    base = simulate(gpipe(2, 4), costs(2))
    c = PipelineCosts([StageCosts(F, B, allreduce_ms=5.0), StageCosts(F, B)], [0.0])
    r = simulate(gpipe(2, 4), c)
    assert r.iteration_ms == pytest.approx(base.iteration_ms + 5.0)
    assert r.allreduce == {0: (base.iteration_ms, base.iteration_ms + 5.0)}
    assert r.busy_ms == base.busy_ms  # all-reduce counts as bubble, not busy
    assert r.bubble_fraction == pytest.approx(1 - 8 * (F + B) / (2 * r.iteration_ms))
    assert simulate(inference(2, 4), c).allreduce == {}


def _slope(builder: object, replicas: list[int], m: int) -> float:
    """Steady-state time per micro-batch: (T(2m) - T(m)) / m."""
    assert callable(builder)
    p = len(replicas)
    t1, t2 = (
        simulate(builder(p, k, replicas), costs(p, replicas)).iteration_ms for k in (m, 2 * m)
    )
    return float((t2 - t1) / m)


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b, inference])
@pytest.mark.parametrize("replicas", [[1, 2, 1], [2, 1], [1, 3], [1, 2, 3], [3, 2, 1, 2]])
def test_replicated_double_cost_stage_matches_normal_stage(
    builder: object, replicas: list[int]
) -> None:
    per_mb = F if builder is inference else F + B
    assert _slope(builder, replicas, 36) == pytest.approx(per_mb)
    assert _slope(builder, [1] * len(replicas), 36) == pytest.approx(per_mb)
    assert callable(builder)
    p, m = len(replicas), 600
    with_reps = simulate(builder(p, m, replicas), costs(p, replicas))
    plain = simulate(builder(p, m), costs(p))
    assert with_reps.throughput_per_s == pytest.approx(plain.throughput_per_s, rel=0.02)


def test_replicas_take_microbatches_round_robin() -> None:
    s = one_f_one_b(3, 7, [1, 3, 2])
    assert sorted(s) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    for (stage, r), actions in s.items():
        d = [1, 3, 2][stage]
        assert all(a.stage == stage and a.microbatch % d == r for a in actions)
    assert [str(a) for a in gpipe(2, 4, [1, 2])[(1, 1)]] == ["1F1", "1F3", "1B1", "1B3"]
    assert " ".join(map(str, one_f_one_b(3, 4)[(0, 0)])) == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"


def test_builders_are_valid_and_never_deadlock() -> None:
    for p, m in itertools.product(range(1, 5), (1, 2, 3, 7)):
        for reps in itertools.product((1, 2, 3), repeat=p):
            c = costs(p, list(reps))
            for builder, train in ((gpipe, True), (one_f_one_b, True), (inference, False)):
                s = builder(p, m, list(reps))
                validate(s, p, m, train, replicas=list(reps))
                r = simulate(s, c)
                assert len(r.timeline) == p * m * (2 if train else 1)
                for dev in s:  # a device never runs two actions at once
                    spans = [(t0, t1) for d, _, t0, t1 in r.timeline if d == dev]
                    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_validate_catches_bad_schedules() -> None:
    s = one_f_one_b(2, 3)
    s[(1, 0)].remove(Action(1, Kind.B, 2))
    with pytest.raises(ScheduleError, match="1B2 is missing"):
        validate(s, 2, 3, train=True)
    dup = gpipe(2, 2)
    dup[(0, 0)].append(Action(0, Kind.F, 1))
    with pytest.raises(ValueError, match="0F1 appears twice"):
        validate(dup, 2, 2, train=True)
    wrong = inference(2, 2)
    wrong[(0, 0)].append(Action(1, Kind.F, 5))
    with pytest.raises(PartitionError, match="1F5 is on device"):
        validate(wrong, 2, 2, train=False)
    split: Schedule = {
        (0, 0): [Action(0, Kind.F, 0), Action(0, Kind.B, 1)],
        (0, 1): [Action(0, Kind.F, 1), Action(0, Kind.B, 0)],
    }
    with pytest.raises(ScheduleError, match="0F0 on"):
        validate(split, 1, 2, train=True)
    with pytest.raises(ScheduleError, match="devices"):
        validate(gpipe(2, 2), 2, 2, train=True, replicas=[1, 2])
    with pytest.raises(ScheduleError, match="backward in an inference"):
        validate(gpipe(1, 1), 1, 1, train=False)
    with pytest.raises(ScheduleError, match="send_ms"):
        simulate(gpipe(2, 2), PipelineCosts([StageCosts(1, 1)] * 2, []))


def test_deadlock_raises_with_grid() -> None:
    parse = Action.parse
    s: Schedule = {
        (0, 0): [parse(a) for a in ("0F0", "0B0", "0F1", "0B1")],
        (1, 0): [parse(a) for a in ("1F1", "1F0", "1B0", "1B1")],
    }
    with pytest.raises(ValueError, match="deadlock") as info:
        simulate(s, costs(2))
    msg = str(info.value)
    assert "device (0, 0) is stuck at 0B0 waiting for 1B0" in msg
    assert "device (1, 0) is stuck at 1F1 waiting for 0F1" in msg
    assert "[0B0]" in msg and "[1F1]" in msg and " 0F0 " in msg


def test_render_grid() -> None:
    text = render(gpipe(2, 2, train=False))
    assert text.splitlines()[1].split() == ["0,0", "0F0", "0F1"]
    assert text.splitlines()[2].split() == ["1,0", "1F0", "1F1"]


@settings(max_examples=120, deadline=None)
@given(
    replicas=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    microbatches=st.integers(1, 9),
    train=st.booleans(),
    data=st.data(),
)
def test_lower_bound_never_exceeds_the_simulation(
    replicas: list[int], microbatches: int, train: bool, data: st.DataObject
) -> None:
    """The planner skips a proposal whose bound is no better than a simulated plan: the bound
    must hold for every schedule it prunes, and be tight for a single stage."""
    times = st.floats(0.0, 10.0, allow_nan=False)
    p = len(replicas)
    stages = [StageCosts(data.draw(times), data.draw(times) if train else 0.0, r,
                         data.draw(times) if train and r > 1 else 0.0) for r in replicas]
    costs = PipelineCosts(stages, [data.draw(times) for _ in range(p - 1)])
    builder = one_f_one_b if train else inference
    sim = simulate(builder(p, microbatches, replicas), costs)
    bound = lower_bound_ms(costs, microbatches, train)
    assert bound <= sim.iteration_ms * (1 + 1e-9) + 1e-9
    if p == 1:
        assert bound == pytest.approx(sim.iteration_ms)
