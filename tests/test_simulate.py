"""Exact answers for the pipeline schedules and event simulator."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    gpipe,
    inference,
    interleaved,
    one_f_one_b,
    render,
    validate,
)
from onnx_partition.pipeline.simulate import (
    PipelineCosts,
    StageCosts,
    bubble_closed_form,
    bubble_closed_form_interleaved,
    pipeline_time_closed_form,
    simulate,
)
from onnx_partition.solve.scoring import lower_bound_ms

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


# ------------------------------------------------------------------ interleaved 1F1B


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 12])
def test_interleaved_with_one_chunk_is_one_f_one_b(p: int, m: int) -> None:
    assert interleaved(p, m, 1) == one_f_one_b(p, m)
    assert interleaved(p, m, 1, [1] * p) == one_f_one_b(p, m)
    reps = [1 + s % 3 for s in range(p)]  # one stage per device: any replicas, as 1F1B
    assert interleaved(p, m, 1, reps) == one_f_one_b(p, m, reps)


def test_interleaved_follows_megatrons_order() -> None:
    """p = 2 devices, v = 2 chunks, M = 4: device d hosts stages d and d + 2; warm-ups of
    2 (p - d - 1) + (v - 1) p = 4 and 2 forward steps (Narayanan et al., SC'21, fig. 4)."""
    s = interleaved(4, 4, 2)
    assert sorted(s) == [(0, 0), (1, 0)]
    assert " ".join(map(str, s[(0, 0)])) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3")
    assert " ".join(map(str, s[(1, 0)])) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3")
    # replicas are independent pipelines: replica r takes micro-batches r, r + R, ...
    two = interleaved(4, 8, 2, [2] * 4)
    assert sorted(two) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (d, r), actions in two.items():
        assert [(a.stage, a.kind) for a in actions] == [(a.stage, a.kind) for a in s[(d, 0)]]
        assert [a.microbatch for a in actions] == [2 * a.microbatch + r for a in s[(d, 0)]]


@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
@pytest.mark.parametrize(
    ("p", "v", "m"),
    [(1, 2, 3), (2, 2, 2), (2, 2, 8), (2, 4, 6), (3, 2, 3), (3, 3, 9), (4, 2, 4), (4, 2, 8),
     (4, 3, 12), (4, 4, 8), (5, 2, 10), (8, 2, 16), (8, 4, 8)],
)
def test_interleaved_matches_closed_form(f: float, b: float, p: int, v: int, m: int) -> None:
    """Equal chunks, no communication: ``(m + (p-1)/v) v (f + b)``, bubble ``(p-1)/v`` of a
    device's micro-batch, as the paper states; the bubble shrinks v-fold against 1F1B."""
    n = p * v
    c = PipelineCosts([StageCosts(f, b) for _ in range(n)], [0.0] * (n - 1))
    r = simulate(interleaved(n, m, v), c)
    per_mb = v * (f + b)  # one device's forward + backward of a micro-batch, all its chunks
    assert r.iteration_ms == pytest.approx((m + (p - 1) / v) * per_mb)
    assert r.bubble_fraction == pytest.approx(bubble_closed_form_interleaved(p, m, v))
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert all(t == pytest.approx(m * per_mb) for t in r.busy_ms.values())
    # 1F1B on the same p devices (each a stage of v chunks) pays the full (p-1) micro-batches
    whole = PipelineCosts([StageCosts(v * f, v * b) for _ in range(p)], [0.0] * (p - 1))
    plain = simulate(one_f_one_b(p, m), whole)
    assert plain.iteration_ms == pytest.approx(pipeline_time_closed_form(per_mb, p, m))
    assert r.iteration_ms <= plain.iteration_ms + 1e-9
    assert bubble_closed_form_interleaved(p, m, 1) == bubble_closed_form(p, m)


def test_interleaved_is_valid_and_never_deadlocks() -> None:
    for p, v, reps, k in itertools.product(range(1, 5), range(1, 5), (1, 2, 3), (1, 2)):
        n, m = p * v, p * reps * k
        replicas = [reps] * n
        s = interleaved(n, m, v, replicas)
        validate(s, n, m, train=True, replicas=replicas)
        assert sorted(s) == [(d, r) for d in range(p) for r in range(reps)]
        for (d, r), actions in s.items():
            assert {a.stage for a in actions} == set(range(d, n, p))
            assert all(a.microbatch % reps == r for a in actions)
        sends = [0.1 * (i % 3) for i in range(n - 1)]
        c = PipelineCosts([StageCosts(1.0 + i % 2, 2.0, reps) for i in range(n)], sends)
        result = simulate(s, c)
        assert len(result.timeline) == 2 * n * m
        for dev in s:  # a device never runs two actions at once
            spans = [(t0, t1) for d, _, t0, t1 in result.timeline if d == dev]
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_interleaved_rejects_bad_arguments() -> None:
    with pytest.raises(ScheduleError, match="at least one model chunk"):
        interleaved(4, 4, 0)
    with pytest.raises(ScheduleError, match="chunk count must divide the stage count"):
        interleaved(6, 4, 4)
    with pytest.raises(ScheduleError, match=r"multiples of 2 devices = 2, got 3"):
        interleaved(4, 3, 2)
    with pytest.raises(ScheduleError, match=r"multiples of 2 devices x 3 replicas = 6, got 4"):
        interleaved(4, 4, 2, [3] * 4)
    with pytest.raises(PartitionError, match=r"same replica count in every stage, got \[1, 2"):
        interleaved(4, 4, 2, [1, 2, 1, 2])
    with pytest.raises(ScheduleError, match="at least one micro-batch"):
        interleaved(4, 0, 2)
    with pytest.raises(ScheduleError, match="replicas must be 4 counts"):
        interleaved(4, 4, 2, [1, 1])


def _stash_peaks(schedule: Schedule, act: list[float]) -> dict[tuple[int, int], float]:
    """Peak activation bytes held by each device, replaying its action list."""
    peaks = {}
    for dev, actions in schedule.items():
        held = peak = 0.0
        for a in actions:
            held += act[a.stage] if a.kind is Kind.F else -act[a.stage]
            peak = max(peak, held)
        peaks[dev] = peak
    return peaks


def test_device_hosting_several_stages_adds_their_memory() -> None:
    static, act = [1000.0, 500.0], [10.0, 30.0]
    c = PipelineCosts([StageCosts(F, B, static_bytes=s, activation_bytes=a)
                       for s, a in zip(static, act, strict=True)], [0.0])
    s = interleaved(2, 2, 2)  # one device, two chunks
    assert " ".join(map(str, s[(0, 0)])) == "0F0 1F0 1B0 0F1 0B0 1F1 1B1 0B1"
    r = simulate(s, c)
    assert r.peak_inflight == {(0, 0): 2}
    assert r.peak_memory_bytes == {(0, 0): 1000.0 + 500.0 + 10.0 + 30.0}
    assert r.busy_ms == {(0, 0): pytest.approx(2 * 2 * (F + B))}
    # inference on a shared device: both statics, the larger activation
    fwd: Schedule = {(0, 0): [Action.parse(t) for t in ("0F0", "1F0", "0F1", "1F1")]}
    validate(fwd, 2, 2, train=False, replicas=[1, 1])
    i = simulate(fwd, c)
    assert i.peak_memory_bytes == {(0, 0): 1500.0 + 30.0} and i.peak_inflight == {(0, 0): 0}
    assert i.iteration_ms == pytest.approx(4 * F)
    # p = 4 devices of 2 chunks and 2 replicas: statics summed, stash peak over time
    n, m = 8, 16
    static, act = [100.0 * (i + 1) for i in range(n)], [1.0 + i for i in range(n)]
    c = PipelineCosts([StageCosts(F, B, 2, 0.0, a, st)
                       for a, st in zip(act, static, strict=True)], [0.0] * (n - 1))
    s = interleaved(n, m, 2, [2] * n)
    r = simulate(s, c)
    peaks = _stash_peaks(s, act)
    for (d, rep), mem in r.peak_memory_bytes.items():
        assert mem == pytest.approx(static[d] + static[d + 4] + peaks[(d, rep)])
    assert r.peak_inflight[(0, 0)] == 2 * (4 - 1) + (2 - 1) * 4 + 1  # warm-up + 1 chunks


def test_allreduces_of_a_shared_device_run_one_after_another() -> None:
    c = PipelineCosts([StageCosts(F, B, 2, 5.0), StageCosts(F, B, 2, 3.0)], [0.0])
    r = simulate(interleaved(2, 4, 2, [2, 2]), c)
    t = max(t1 for _, _, _, t1 in r.timeline)
    assert t == pytest.approx(2 * 2 * (F + B))  # each replica: 2 micro-batches x 2 chunks
    assert r.allreduce == {0: (t, t + 5.0), 1: (t + 5.0, t + 8.0)}
    assert r.iteration_ms == pytest.approx(t + 8.0)


def test_validate_interleaved_layout() -> None:
    s = interleaved(4, 2, 2)
    validate(s, 4, 2, train=True, replicas=[1] * 4)
    s[(0, 0)].append(s[(1, 0)].pop())  # 1B1 onto the device of stages 0 and 2
    with pytest.raises(ScheduleError, match=r"1B1 is on device \(0, 0\) of first stage 0"):
        validate(s, 4, 2, train=True)
    with pytest.raises(ScheduleError, match=r"stages \[0, 2\] share device 0 but have replica"):
        validate(interleaved(4, 2, 2), 4, 2, train=True, replicas=[1, 1, 2, 1])


def test_at_rows_scales_the_per_row_terms_only() -> None:
    """One stage, two micro-batches (F0 B0 F1 B1): at twice the rows the forwards, backwards
    and hops double; the per-step term, the accumulation and the all-reduce do not (issue 20
    item 3: ``train`` at another batch size scaled the whole iteration, 33 ms here)."""
    one = PipelineCosts([StageCosts(1.0, 2.0, step_ms=10.0, accumulate_ms=0.5)], [])
    assert simulate(one_f_one_b(1, 2), one).iteration_ms == pytest.approx(16.5)
    assert simulate(one_f_one_b(1, 2), one.at_rows(2.0)).iteration_ms == pytest.approx(22.5)
    assert one.at_rows(1.0) is one
    two = PipelineCosts([StageCosts(1.0, 2.0, backward_input_ms=0.5, allreduce_ms=3.0,
                                    activation_bytes=8.0, static_bytes=5.0, input_bytes=2.0),
                         StageCosts(1.0, 2.0)], [0.25])
    got = two.at_rows(3.0)
    assert got.send_ms == [0.75]
    assert (got.stages[0].forward_ms, got.stages[0].backward_ms, got.stages[0].split(),
            got.stages[0].allreduce_ms, got.stages[0].activation_bytes,
            got.stages[0].static_bytes, got.stages[0].input_bytes) == (
        3.0, 6.0, (1.5, 4.5), 3.0, 24.0, 5.0, 6.0)
