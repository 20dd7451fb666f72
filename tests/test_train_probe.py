"""The engine probe (runtime/train/probe.py) on a real two-process run, and the reading it shares
with ``profile --plan`` (runtime/train/overheads.py): a run as the simulator's costs, and the
extra per hop fitted to the measured step, exact on hand-made cases."""

from __future__ import annotations

import math

import pytest
from support.spans import Result

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.runtime.train.overheads import RunCosts, fit_hop_ms, run_costs, run_pipeline
from onnx_partition.runtime.train.probe import busy_warning, probe_engine


def test_the_hop_fit_is_exact_on_two_stages() -> None:
    # GPipe, one micro-batch: F0 1, hop, F1 1, B1 2, hop, B0 2, then the step's 0.5:
    # 6.5 + 2 x (0.5 + h); a measured 10 needs h = 1.25
    grid = schedules.build("gpipe", [1, 1], 1)
    costs = PipelineCosts([StageCosts(1.0, 2.0, step_ms=0.5), StageCosts(1.0, 2.0)], [0.5])
    assert simulate(grid, costs).iteration_ms == pytest.approx(7.5)
    assert fit_hop_ms(grid, costs, 10.0) == pytest.approx(1.25, abs=1e-5)
    # the costs already reach the step, or there is no hop: nothing to add
    assert fit_hop_ms(grid, costs, 7.0) == 0.0
    alone = PipelineCosts([StageCosts(1.0, 2.0)], [])
    assert fit_hop_ms(schedules.build("gpipe", [1], 1), alone, 9.0) == 0.0


def test_a_run_reads_as_the_simulators_costs() -> None:
    # two steps, the first left out; stage 0 runs F, I, W of one micro-batch, stage 1 F, B
    warm = [("x", 0.0, 1.0, 0.0)]
    zero = [("0F0", 0.0, 2.0, 0.0), ("0I0", 3.0, 4.5, 0.5), ("0W0", 5.0, 9.0, 0.0)]
    one = [("1F0", 0.0, 4.0, 1.0), ("1B0", 4.0, 10.0, 2.0)]
    tail = {"sends_ms": 0.5, "grad_sum_ms": 0.25, "norm_ms": 1.0, "optimizer_ms": 2.0}
    first = Result(0, [99.0, 14.0], [9.0, 1.5], [9.0, 4.0], [warm, zero], [tail, tail])
    last = Result(1, [99.0, 16.0], [9.0, 2.0], [9.0, 3.0], [warm, one], [tail, tail])
    run = run_costs([first, last], 1, split=True)
    # stage 0: end 9, compute 5.5, blocked 0.5 -> 3 over 3 actions; stage 1: end 10, compute 5,
    # blocked 3 -> 2 over 2 actions. I share of stage 0: 1 of 1 + 4; stage 1 has none: half
    assert run == RunCosts(forward_ms=[1.5, 2.0], backward_ms=[4.0, 3.0],
                           backward_input_ms=[0.8, 1.5], action_ms=[1.0, 1.0],
                           tail_ms=[2.75, 2.75], replicas=[1, 1],
                           barrier_ms=run.barrier_ms, measured_ms=15.0)
    # closing: 14 - 9 - 3.75 = 1.25 and 16 - 10 - 3.75 = 2.25; least norm 1, least closing 1.25
    assert run.barrier_ms == pytest.approx(1.125)
    costs = run_pipeline(run, [0.25], hop_ms=0.5)
    assert costs.send_ms == [0.75]
    # every action takes its stage's action_ms: F, I and W under the split
    f0, i0, w0 = (costs.stages[0].duration(k) for k in
                  (schedules.Kind.F, schedules.Kind.I, schedules.Kind.W))
    assert (f0, i0, w0) == pytest.approx((2.5, 1.8, 4.2))
    assert costs.stages[0].step_ms == pytest.approx(2.75 + 2 * 1.125)


def test_the_tied_all_reduce_costs_what_its_last_holder_pays() -> None:
    # stage 0 waited 3 ms in the tied gradients' all-reduce for stage 1, which paid 0.5 for the
    # collective itself; a third stage holds no tied parameter
    spans = [[("kF0", 0.0, 2.0, 0.0)]] * 2

    def tail(tied: float) -> dict[str, float]:
        return {"sends_ms": 0.0, "grad_sum_ms": tied, "norm_ms": 1.0, "optimizer_ms": 1.0}

    ranks = [Result(k, [20.0, 20.0], [1.0, 1.0], [0.5, 0.5], spans, [tail(t), tail(t)])
             for k, t in enumerate((3.5, 0.5, 0.0))]
    run = run_costs(ranks, 1, split=False)
    assert run.tail_ms == [1.5, 1.5, 1.0]


def test_the_probe_measures_the_engine() -> None:
    got = probe_engine(steps=3)
    for key in ("action_ms", "barrier_ms", "hop_ms", "send_ms", "step_ms", "simulated_ms"):
        assert math.isfinite(got[key]) and got[key] >= 0, key
    assert got["action_ms"] > 0 and got["step_ms"] > 0
    assert got["schedule"] == "zb-h1" and got["steps"] == 3 and got["hop_bytes"] > 0
    assert got["load_average"] >= 0
    if got["hop_ms"] > 0:  # fitted: its simulation lasts the measured step
        assert got["simulated_ms"] == pytest.approx(got["step_ms"], abs=1e-3)


def test_the_probe_warns_when_the_machine_is_busy() -> None:
    """Above one runnable process per core the fit takes others' time slices for hop cost."""
    assert busy_warning(2.0, 2) is None and busy_warning(0.3, 16) is None
    said = busy_warning(6.2, 2)
    assert said is not None and said.startswith("warning: load average 6.2 on 2 cores")
    assert "\n" not in said
