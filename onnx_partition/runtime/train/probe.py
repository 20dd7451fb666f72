"""The engine probe: what ``train``'s engine costs besides compute, measured on a small
pipeline built in memory, for the costs file's ``engine.probe`` (``profile --mode train`` on
CPU; :func:`onnx_partition.cost.profile.engine.measure_engine` takes it as ``probe=``).

The pipeline: two stages, each :data:`LAYERS` ``Linear(WIDTH, WIDTH) + GELU`` at :data:`ROWS`
rows per micro-batch (one forward of a few ms on one thread of a 2-core CPU VM; a hop of
``ROWS x WIDTH`` fp32, 96 KiB), trained by the real engine
(:func:`~onnx_partition.runtime.train.rank.train_stages` in two spawned gloo processes, the
launcher ``train`` uses, one torch thread each, synthetic batches) under ZB-H1 with
:data:`MICROBATCHES` micro-batches for :data:`STEPS` steps, the first two left out. So both cores
compute while the hops cross, as in a real run. From the ranks' results
(:mod:`~onnx_partition.runtime.train.overheads`):

* ``action_ms``: the engine's work per action, the mean over ranks;
* ``barrier_ms``: one of the step's barriers as the rank arriving last pays it;
* ``hop_ms``: what a hop costs beyond an idle ping-pong of the same bytes (``send_ms``: the
  costs file's link at those bytes, or two more processes):
  :func:`~onnx_partition.runtime.train.overheads.fit_hop_ms` of the run's costs (its compute
  per micro-batch, ``action_ms`` on every action, the tail and barriers as ``step_ms``)
  against the measured step.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.simulate import simulate
from onnx_partition.plan import IOSpec, Plan, Stage
from onnx_partition.request.train import resolve_job, train_job
from onnx_partition.runtime.train.overheads import fit_hop_ms, run_costs, run_pipeline
from onnx_partition.runtime.train.rank_io import RankRun
from onnx_partition.runtime.train.spawn import launch_training
from onnx_partition.settings.train import LOCAL_TIMEOUT_S

__all__ = ["LAYERS", "MICROBATCHES", "ROWS", "SCHEDULE", "STEPS", "WIDTH", "busy_warning",
           "probe_engine"]

WIDTH = 512  # features through every layer
ROWS = 48  # rows per micro-batch: a hop of 48 x 512 fp32, 96 KiB
LAYERS = 2  # Linear + GELU per stage
MICROBATCHES = 4
STEPS = 6  # the first two left out (overheads.timed_from)
SCHEDULE = "zb-h1"


class _Stage:
    """One probe stage (the fields of ``runtime.train.modules.StageModule`` the engine
    reads): ``LAYERS`` Linear + GELU, built from the stage's seed."""

    def __init__(self, index: int, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        self.index, self.inputs, self.outputs = index, inputs, outputs
        self.tied: dict[str, tuple[int, ...]] = {}
        torch.manual_seed(index)
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        self._module = _Tupled(nn.Sequential(*layers))

    @property
    def module(self) -> nn.Module:
        return self._module


class _Tupled(nn.Module):
    """A stage module returns a tuple of its outputs."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.body(x),)


def _loss(outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(outputs["y"], targets["y"])


def _batch(step: int, rows: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(step)
    return ({"x": torch.randn(rows, WIDTH, generator=gen)},
            {"y": torch.randn(rows, WIDTH, generator=gen)})


def _plan() -> Plan:
    spec: list[int | str] = ["N", WIDTH]
    return Plan(model="probe", stages=[Stage(0, "stage_0", [], ["x"], ["h"]),
                                       Stage(1, "stage_1", [], ["h"], ["y"])],
                inputs=[IOSpec("x", "float32", list(spec))],
                outputs=[IOSpec("y", "float32", list(spec))], mode="train")


def _job() -> tuple[list[_Stage], Any, Plan, Any]:
    """What every rank builds (module level: it pickles to the spawned ranks)."""
    stages = [_Stage(0, ("x",), ("h",)), _Stage(1, ("h",), ("y",))]
    return stages, _loss, _plan(), functools.partial(_batch, rows=ROWS * MICROBATCHES)


def busy_warning(load: float, cores: int) -> str | None:
    """The line to print when the machine's 1-minute load average ``load`` exceeds its
    ``cores`` (None otherwise): the probe's fit then takes other processes' time slices for
    engine work per hop (at load 6 on 2 cores it fitted 15.4 ms a hop, and a plan priced with
    it predicted 131 ms for a 34 ms step)."""
    if load <= cores:
        return None
    return (f"warning: load average {load:.1f} on {cores} cores while the engine probe ran: "
            f"its per-hop cost counts other processes' time; profile again on a quiet "
            f"machine for a plan's true step time")


def probe_engine(link: Mapping[str, Any] | None = None, *, steps: int = STEPS,
                 timeout_s: float = LOCAL_TIMEOUT_S) -> dict[str, Any]:
    """Run the probe (module docstring): ``{"action_ms", "barrier_ms", "hop_ms", "send_ms",
    "step_ms", "simulated_ms", "schedule", "microbatches", "steps", "hop_bytes", "load_average",
    "source"}``
    (ms; ``send_ms`` the idle hop, ``step_ms`` the measured step, ``simulated_ms`` the fit's).
    The idle hop is ``link``'s (a costs file's ``engine.link``: its ping-pong's ``sizes`` and
    ``one_way_ms``, priced at the probe's bytes as ``partition`` prices every hop, so that
    ``hop_ms`` is what to add to those), else a ping-pong of the probe's bytes."""
    from onnx_partition.cost.engine_price import hop_ms
    from onnx_partition.cost.profile.engine import measure_hops

    if steps < 2:
        raise ValueError("the probe needs at least 2 steps (the first is left out)")
    plan = _plan()
    job, _ = resolve_job(train_job(steps=steps, microbatches=MICROBATCHES, schedule=SCHEDULE,
                                   optimizer="adamw", lr=1e-4, threads=1), plan)
    ranks = launch_training(plan, _job, RankRun(job), backend="gloo", timeout_s=timeout_s)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    said = busy_warning(load, os.cpu_count() or 1)
    if said:
        print(said, file=sys.stderr)
    hop_bytes = ROWS * WIDTH * 4
    idle = "the link" if link is not None else "a ping-pong"
    if link is not None:
        send = hop_ms(hop_bytes, link["sizes"], link["one_way_ms"])
    else:
        (send,), _ = measure_hops([hop_bytes], repeats=10, threads=1)
    run = run_costs(ranks, MICROBATCHES, split=True)
    schedule = schedules.build(SCHEDULE, run.replicas, MICROBATCHES)
    hop = fit_hop_ms(schedule, run_pipeline(run, [send]), run.measured_ms)
    fitted = simulate(schedule, run_pipeline(run, [send], hop_ms=hop)).iteration_ms
    return {"action_ms": round(sum(run.action_ms) / len(run.action_ms), 6),
            "barrier_ms": round(run.barrier_ms, 6), "hop_ms": round(hop, 6),
            "send_ms": round(send, 6), "step_ms": round(run.measured_ms, 6),
            "simulated_ms": round(fitted, 6), "schedule": SCHEDULE,
            "microbatches": MICROBATCHES, "steps": steps, "hop_bytes": hop_bytes,
            "load_average": round(load, 2),
            "source": (f"the engine on 2 gloo processes, one thread each: 2 stages of "
                       f"{LAYERS} x Linear({WIDTH}) + GELU at {ROWS} rows, {SCHEDULE}, "
                       f"{MICROBATCHES} micro-batches, {steps} steps (first two left out); hop_ms "
                       f"fitted over the idle hop ({idle}'s send_ms) to the measured step")}
