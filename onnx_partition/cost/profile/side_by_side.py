"""How much slower a training process computes beside another one on the same CPU: the factor
``profile --mode train`` records as its settings' ``side_by_side``.

``profile --mode train`` times the whole program alone, in one process, in a tight loop (a
forward, its backward, again). ``train`` on CPU runs one process per stage side by side on the
same machine, and each stage's compute there costs more than alone *in the thread's own CPU
time* (not scheduling): the neighbour shares the caches and the memory bandwidth, and the
pipeline keeps several micro-batches in flight (1F1B's first stage runs the forwards of two
micro-batches before the first one's backward), so a backward finds less of its forward's
tensors in cache than the tight loop does. :func:`measure_side_by_side` times the whole
program's forward and backward in thread CPU time (``time.thread_time``: what other processes'
scheduling does not stretch) in two patterns:

* ``tight``: forward, backward, as the profile does;
* ``interleaved``: two forwards, then their two backwards (1F1B's steady state on a first stage);

each alone and ``together``: while a co-runner (a spawned process with the same torch threads
and its own copy of the program, weights and inputs, warmed up first) steps the program in the
interleaved pattern, as the neighbour stage would. Alone and together take turns, round by
round (the co-runner paused and resumed by events; each turn's first round untimed, so that an
alone round starts from its own caches, as the profile's loop does), so that whatever else
loads the machine weighs on both alike. The factor is :data:`PATTERN`'s pair, together over
alone, at least 1 (a second process sharing the caches and memory bandwidth cannot make the
compute faster: a ratio under 1 is the measurement's noise, which put inception's forward at
0.87). ``tools/bench_side_by_side.py`` chose the pair against the run's own ratios (its thread
CPU time over the profile's alone; docs/benchmarks.md): the co-run is what slows the compute,
interleaving alone does not (0.89-1.08), and the co-run in the interleaved pattern came
closest (mean |log error| 0.085, against 0.147 unscaled). On one CPU there is no other core to
share: nothing is measured.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import time
from statistics import median
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

__all__ = ["PATTERN", "PATTERNS", "cpus", "measure_side_by_side"]

PATTERNS = ("tight", "interleaved")
#: The pattern, alone and together, whose ratio is the factor (docs/benchmarks.md).
PATTERN = ("alone-tight", "together-interleaved")
READY_TIMEOUT_S = 600.0  # a co-runner not ready by then (loading the program) is given up


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1



class _Stepper:
    """The whole program's forward (to a loss: the sum of its outputs) and backward, timed in
    this thread's CPU time (ms)."""

    def __init__(self, program: ExportedProgram, args: list[Any]) -> None:
        self.module, self.args = program.graph_module, args

    def forward(self) -> torch.Tensor:
        import torch
        from torch.utils._pytree import tree_flatten

        with torch.enable_grad():
            result = self.module(*self.args)
        outs = [t for t in tree_flatten(result)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad]
        return sum((o.float().sum() for o in outs), torch.zeros(()))

    def clear(self) -> None:
        for a in self.args:
            if getattr(a, "grad", None) is not None:
                a.grad = None

    def run(self, pattern: str, times: tuple[list[float], list[float]] | None = None) -> None:
        """One round of ``pattern`` (``tight``: F B; ``interleaved``: F F B B), each forward's
        and backward's CPU ms appended to ``times`` where given."""
        flights = 1 if pattern == "tight" else 2
        losses = []
        for _ in range(flights):
            start = time.thread_time()
            losses.append(self.forward())
            if times is not None:
                times[0].append((time.thread_time() - start) * 1e3)
        for loss in losses:
            start = time.thread_time()
            loss.backward()
            if times is not None:
                times[1].append((time.thread_time() - start) * 1e3)
        self.clear()


def _co_run(blob: bytes, args: list[tuple[Any, bool]], threads: int,
            events: dict[str, Any]) -> None:
    """The co-runner (a spawned process): load the program, warm up, say ``ready``, then step
    it on its copy of ``args`` (each with whether it needs a gradient) in the interleaved
    pattern while ``go`` is set, ``idle`` (set) while it is not, until ``stop``."""
    import torch

    torch.set_num_threads(threads)
    program = torch.export.load(io.BytesIO(blob))
    stepper = _Stepper(program, [a.requires_grad_(True) if grad else a for a, grad in args])
    stepper.run("interleaved")
    events["ready"].set()
    while not events["stop"].is_set():
        if not events["go"].is_set():
            events["idle"].set()
            events["go"].wait(1.0)
            continue
        events["idle"].clear()
        stepper.run("interleaved")
    events["idle"].set()


def measure_side_by_side(program: ExportedProgram, args: list[Any], *, repeats: int,
                         warmup: int, threads: int) -> dict[str, Any]:
    """The whole program's forward and backward CPU ms (medians) per pattern alone and beside a
    co-runner (module docstring), and the factor: ``forward`` and ``backward`` = together /
    alone in :data:`PATTERN`, at least 1. ``args``: the graph module's arguments on CPU
    (weights needing gradients, then the user inputs); the co-runner gets a copy. With fewer
    than 2 CPUs: ``{"skipped": why}``."""
    import torch

    if cpus() < 2:
        return {"skipped": "1 CPU: no other core for a second process to share"}
    stepper = _Stepper(program, args)
    blob = io.BytesIO()
    torch.export.save(program, blob)
    ctx = mp.get_context("spawn")
    events = {name: ctx.Event() for name in ("ready", "go", "idle", "stop")}
    neighbour = ctx.Process(target=_co_run, daemon=True,
                            args=(blob.getvalue(), [
                                (a.detach(), a.requires_grad) if isinstance(a, torch.Tensor)
                                else (a, False) for a in args], threads, events))
    neighbour.start()
    times: dict[str, tuple[list[float], list[float]]] = {
        f"{w}-{p}": ([], []) for w in ("alone", "together") for p in PATTERNS}
    try:
        if not events["ready"].wait(READY_TIMEOUT_S) or not neighbour.is_alive():
            return {"skipped": f"the co-runner was not ready in {READY_TIMEOUT_S:.0f} s"}
        for i in range(warmup + repeats):  # alone and together in turn: the same outside load
            for pattern in PATTERNS:
                events["go"].clear()
                events["idle"].wait(60.0)
                stepper.run(pattern)  # what the co-runner left in the caches, replaced
                stepper.run(pattern, times[f"alone-{pattern}"] if i >= warmup else None)
                events["go"].set()
                while events["idle"].is_set() and neighbour.is_alive():
                    time.sleep(0.0005)
                stepper.run(pattern)
                stepper.run(pattern, times[f"together-{pattern}"] if i >= warmup else None)
    finally:
        events["stop"].set()
        events["go"].set()
        neighbour.join(30.0)
        if neighbour.is_alive():
            neighbour.kill()
            neighbour.join()
    ms = {k: (median(f), median(b)) for k, (f, b) in times.items()}
    base, beside = ms[PATTERN[0]], ms[PATTERN[1]]
    ratios = [b / a if a > 0 else 1.0 for a, b in zip(base, beside, strict=True)]
    return {
        "forward": round(max(1.0, ratios[0]), 4),
        "backward": round(max(1.0, ratios[1]), 4),
        "processes": 2,
        "source": (f"the whole program's thread CPU time, {PATTERN[1]} over {PATTERN[0]}, at "
                   f"least 1: medians of {repeats} rounds, alone and beside a co-runner "
                   "process stepping it (two forwards, then their backwards) in turn"),
        "measured": {"forward": round(ratios[0], 4), "backward": round(ratios[1], 4)},
        "cpu_ms": {k: [round(v, 4) for v in ms[k]] for k in times},
    }
