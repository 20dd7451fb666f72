"""``profile --plan`` calibrates a train plan's memory model on its run (calibrate/memory.py):
the measured activations replace the counted ones, the peak's remainder over the counted
parameters becomes the buffers, the simulator replays the measured peak, and a stage the run
did not measure (or that recomputes) stays as priced."""

from __future__ import annotations

import copy
from typing import Any

from onnx_partition.calibrate.memory import memory_calibrated
from onnx_partition.pipeline.memory import device_bytes
from onnx_partition.plan import Plan


def _stage(index: int, **extra: Any) -> dict[str, Any]:
    return {"index": index, "file": f"stage_{index}.onnx", "nodes": [f"n{index}"],
            "inputs": ["x" if index == 0 else "t"], "outputs": ["t" if index == 0 else "y"],
            "replicas": 1, "devices": ["cpu"], "constants": [], "sha256": "",
            "predicted": {"compute_ms": 1.0, "comm_ms": 0.0, "memory_bytes": 510,
                          "forward_ms": 0.5, "backward_ms": 0.5, "weights_bytes": 100,
                          "grad_bytes": 100, "optimizer_bytes": 200, "activation_bytes": 50,
                          "inflight": 2, "buffer_bytes": 10}, **extra}


def _plan(recompute: bool = False) -> Plan:
    return Plan.from_json({
        "format": "onnx-partition/plan@2", "model": "../m.onnx", "mode": "train",
        "ordering": "topo", "solver": "dp", "program": "", "program_sha256": "",
        "stages": [_stage(0), _stage(1, **({"recompute": True} if recompute else {}))],
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 4], "high": None}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [2, 4], "high": None}],
        "predicted": {"iteration_ms": 3.0, "microbatches": 4, "bottleneck_ms": 1.0},
        "simulator_costs": {"activation_bytes": [60, 60], "static_bytes": [390, 390]}})


def test_the_parts_take_the_runs_measures():
    plan = _plan()
    record = memory_calibrated(plan, [80, None], [700, 900])
    first, second = plan.stages[0].predicted, plan.stages[1].predicted
    assert first is not None and second is not None
    assert (first.activation_bytes, first.buffer_bytes, first.memory_bytes) == (80, 140, 700)
    assert (first.weights_bytes, first.grad_bytes, first.optimizer_bytes) == (100, 100, 200)
    sim = plan.simulator_costs
    assert sim.activation_bytes == [90.0, 60.0] and sim.static_bytes == [520.0, 390.0]
    assert device_bytes(sim.static_bytes[0], sim.activation_bytes[0], 2) == 700  # replayed
    assert (second.activation_bytes, second.memory_bytes) == (50, 510)  # not measured
    assert [s["calibrated"] for s in record["stages"]] == [True, False]
    assert record["stages"][0]["priced_bytes"] == 510


def test_a_peak_under_the_counted_parameters_keeps_no_buffers():
    plan = _plan()
    memory_calibrated(plan, [80, 80], [300, 300])
    pred = plan.stages[0].predicted
    assert pred is not None and pred.buffer_bytes == 0 and pred.memory_bytes == 560


def test_a_recomputing_stage_stays_as_priced():
    plan = _plan(recompute=True)
    before = copy.deepcopy(plan.stages[1].predicted)
    record = memory_calibrated(plan, [80, 80], [700, 700])
    assert plan.stages[1].predicted == before
    assert [s["calibrated"] for s in record["stages"]] == [True, False]


def test_a_plan_without_the_simulators_arrays_gets_its_parts_calibrated():
    plan = _plan()
    plan.simulator_costs.activation_bytes = plan.simulator_costs.static_bytes = None
    memory_calibrated(plan, [80, 80], [700, 700])
    pred = plan.stages[0].predicted
    assert pred is not None and (pred.activation_bytes, pred.memory_bytes) == (80, 700)
    assert plan.simulator_costs.activation_bytes is None
