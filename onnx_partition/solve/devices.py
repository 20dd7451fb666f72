"""Devices cost: among plans within :data:`DEVICE_SLACK` of the fastest simulated iteration,
the one on the fewest devices wins (:func:`fewest_devices`), with the summary's lines on what
more devices would buy and why some are left unused (:func:`devices_notes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from onnx_partition.solve.scoring import HybridPlan, RunSpec

__all__ = ["DEVICE_SLACK", "devices_notes", "fewest_devices"]

#: Devices cost: among plans within this fraction of the fastest, the fewest devices win.
DEVICE_SLACK = 0.02


def fewest_devices(fastest: HybridPlan, played: Sequence[HybridPlan],
                   run: RunSpec) -> HybridPlan:
    """Devices cost: among ``fastest`` and the plans ``played`` within DEVICE_SLACK of its
    iteration, the one on the fewest devices (then the fastest), with notes saying what
    more devices would buy and why devices are left unused."""
    limit = fastest.sim.iteration_ms * (1 + DEVICE_SLACK)
    pool = [fastest, *(p for p in played if p.sim.iteration_ms <= limit)]
    chosen = min(pool, key=lambda p: (sum(p.replicas), p.sim.iteration_ms))
    return replace(chosen, notes=devices_notes(chosen, fastest, run))


def devices_notes(plan: HybridPlan, fastest: HybridPlan, run: RunSpec) -> list[str]:
    """The summary's lines on devices: what the fastest plan's extra devices would buy, and
    why devices are left unused (micro-batches feed at most ``M`` replicas per stage)."""
    notes = []
    used, total, m = sum(plan.replicas), run.cluster.devices, run.microbatches
    if sum(fastest.replicas) > used:
        gain = 1 - fastest.sim.iteration_ms / plan.sim.iteration_ms
        notes.append(f"devices: {sum(fastest.replicas)} devices would buy {gain:.2%} "
                     f"({fastest.sim.iteration_ms:.6g} ms per iteration against "
                     f"{plan.sim.iteration_ms:.6g} ms on {used}); within {DEVICE_SLACK:.0%} of "
                     f"the fastest the fewest devices win")
    if used < total and (max(plan.replicas) >= m or run.max_stages * m < total):
        notes.append(f"devices: {total - used} of {total} unused: {m} micro-batches feed at "
                     f"most {m} replicas of a stage (replica j takes micro-batches m = j mod r)"
                     f", {run.max_stages * m} devices over {run.max_stages} stages; more "
                     f"micro-batches per iteration (--microbatches) would let stages use more")
    elif used < total and sum(fastest.replicas) <= used:
        notes.append(f"devices: {total - used} of {total} unused: no plan found on more "
                     f"devices is faster (all-reduce, transfers or fill and drain outweigh "
                     f"the shorter period)")
    return notes
