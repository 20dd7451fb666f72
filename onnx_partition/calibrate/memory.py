"""``profile --plan``'s memory: a train plan's memory model calibrated on its own run in the
engine (:func:`~onnx_partition.calibrate.stage_modules.measure_train_run`), part by part.

The model counts a stage's peak as ``weights + gradients + optimizer state + inflight x
activations + buffers`` (plan.json's per-stage ``predicted``, :mod:`onnx_partition.pipeline.
memory`). The run measures two figures per stage (the largest of its replicas'): the bytes
autograd saved per micro-batch (the saved-tensor hook) and the peak of live tensor storages
(:mod:`onnx_partition.runtime.memtrack`). So, per stage:

* **activations**: ``activation_bytes`` becomes the measured bytes per micro-batch (the part
  that grows with the micro-batches in flight);
* **the rest**: the weights, gradients and optimizer state stay as counted (their bytes are
  the parameters'), and ``buffer_bytes`` becomes what the measured peak leaves over them and
  ``inflight x`` the measured activations: the receive buffers, the engine's temporaries and
  whatever else the count misses (0 at least: a peak under the counted parameters leaves the
  model's sum above the measured peak, and says so).

Where plan.json has the simulator's arrays, its ``activation_bytes`` (the stash per
micro-batch: activations and received inputs) takes the measured activations in place of
the counted ones, and its ``static_bytes`` is the calibrated peak less ``inflight x`` that
stash, so simulating the plan at its own micro-batches gives the measured peak, and other
counts follow the model. A stage that
recomputes (its rebuilt activations count differently) or a part the run did not measure is
left as priced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnx_partition.plan import Plan

__all__ = ["memory_calibrated"]


def memory_calibrated(plan: Plan, activation_bytes: Sequence[int | None],
                      peak_bytes: Sequence[int | None]) -> dict[str, Any]:
    """Calibrate ``plan``'s memory on its run (the module docstring), in place; per stage the
    measured figures and the model's before and after, for ``calibrated.engine_run.memory``."""
    sim = plan.simulator_costs
    stash = list(sim.activation_bytes or [])
    static = list(sim.static_bytes or [])
    stages: list[dict[str, Any]] = []
    for k, stage in enumerate(plan.stages):
        pred = stage.predicted
        act = activation_bytes[k] if k < len(activation_bytes) else None
        peak = peak_bytes[k] if k < len(peak_bytes) else None
        parts = None if pred is None else (pred.weights_bytes, pred.grad_bytes,
                                           pred.optimizer_bytes, pred.activation_bytes,
                                           pred.inflight)
        entry: dict[str, Any] = {"index": stage.index, "measured_activation_bytes": act,
                                 "measured_peak_bytes": peak,
                                 "priced_bytes": None if pred is None else pred.memory_bytes}
        if (pred is None or parts is None or None in parts or act is None or peak is None
                or stage.recompute):
            stages.append({**entry, "calibrated": False})
            continue
        weights, grads, state, counted, inflight = (int(v or 0) for v in parts)
        held = weights + grads + state
        buffers = max(0, peak - held - inflight * act)
        pred.activation_bytes, pred.buffer_bytes = act, buffers
        pred.memory_bytes = held + inflight * act + buffers
        if len(stash) == len(static) == len(plan.stages):  # the simulator's arrays, if any
            stash[k] = float(stash[k]) - counted + act
            static[k] = max(0.0, pred.memory_bytes - inflight * stash[k])
        stages.append({**entry, "calibrated": True, "calibrated_bytes": pred.memory_bytes,
                       "buffer_bytes": buffers})
    if len(stash) == len(static) == len(plan.stages):
        sim.activation_bytes = [round(float(s), 3) for s in stash]
        sim.static_bytes = [round(float(s), 3) for s in static]
    return {"by": "the plan run in the engine: the saved-tensor hook's bytes per micro-batch "
                  "and the storage tracker's peak, each stage's largest replica",
            "stages": stages}
