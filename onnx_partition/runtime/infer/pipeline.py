"""Run a plan's stages as a pipeline in one process: a worker thread per stage replica.

Micro-batches stream through the stages (GPipe-style forward pipelining); onnxruntime releases the
GIL while it runs, so stages on different cores overlap. A stage's replicas take micro-batches in
turn (micro-batch ``m`` goes to replica ``m % d``), and outputs are put back in order.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.graph.ort import Provider
from onnx_partition.pipeline import microbatch
from onnx_partition.pipeline.layout import needed_after, replica_of
from onnx_partition.plan import Plan
from onnx_partition.runtime.infer.sessions import NodeArg, StageSession, load_stages, node_args

Env = dict[str, np.ndarray]
Item = tuple[int, Env]  # (micro-batch index, the tensors it carries)
# (where to reply: results or a failure, micro-batch index, tensors)
Task = tuple["queue.SimpleQueue[Item | _Failed]", int, Env]
__all__ = ["PipelineSession", "RunStats", "StageFailed"]  # StageFailed: from errors, as before


@dataclass(frozen=True)
class _Failed:
    """A worker's report of a stage that raised: the line to show and the exception."""

    text: str
    cause: Exception


@dataclass
class RunStats:
    """Measurements of the last :meth:`PipelineSession.run`."""

    wall_ms: float = 0.0
    microbatches: int = 0
    busy_ms: dict[tuple[int, int], float] = field(default_factory=dict)  # (stage, replica)
    # the same compute in the worker thread's CPU time: busy_ms less the time other threads
    # and processes took its core (onnxruntime computes on the calling thread at 1 thread)
    cpu_ms: dict[tuple[int, int], float] = field(default_factory=dict)

    def idle_ms(self) -> dict[tuple[int, int], float]:
        return {k: max(0.0, self.wall_ms - v) for k, v in self.busy_ms.items()}


class PipelineSession:
    """A plan folder behaving like one ``onnxruntime.InferenceSession``.

    >>> session = PipelineSession("plan/")                    # doctest: +SKIP
    >>> logits, = session.run(None, {"input_ids": ids})       # doctest: +SKIP
    """

    def __init__(
        self,
        plan_dir: str | os.PathLike[str],
        providers: Sequence[Provider] | None = None,
        *,
        microbatches: int | None = None,
        threads_per_stage: int = 1,
        timeout_s: float = 600.0,
    ) -> None:
        self.plan: Plan
        self.plan, self.stages = load_stages(
            plan_dir, providers=providers, threads_per_stage=threads_per_stage
        )
        # micro-batches per run(): the plan's (predicted.microbatches, else 8) unless given
        self.microbatches = microbatches if microbatches is not None else self.plan.microbatches
        self.timeout_s = timeout_s
        self.last_stats = RunStats()
        # Names still needed after stage k: later stages' inputs and the graph outputs.
        self._keep = needed_after(self.plan)
        # One long-lived worker thread per stage replica, fed through its own inbox.
        self._inbox: list[list[queue.SimpleQueue[Task | None]]] = [
            [queue.SimpleQueue() for _ in replicas] for replicas in self.stages
        ]
        self._busy: dict[tuple[int, int], float] = {
            (s.index, s.replica): 0.0 for replicas in self.stages for s in replicas
        }
        self._cpu = dict(self._busy)
        threads = [
            threading.Thread(target=_serve,
                             args=(s, self._inbox, self._keep, self._busy, self._cpu),
                             daemon=True, name=f"stage{s.index}.{s.replica}")
            for replicas in self.stages for s in replicas
        ]
        for thread in threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._inbox, threads)

    def get_inputs(self) -> list[NodeArg]:
        """The graph inputs, as onnxruntime's ``get_inputs``: objects with ``.name``,
        ``.shape`` (ints, strings for symbolic dims) and ``.type`` (``"tensor(float)"``)."""
        return node_args(self.plan.inputs)

    def get_outputs(self) -> list[NodeArg]:
        """The graph outputs, like :meth:`get_inputs`; :meth:`run` returns them in this order."""
        return node_args(self.plan.outputs)

    def run(
        self, output_names: Sequence[str] | None, feeds: Mapping[str, np.ndarray]
    ) -> list[np.ndarray]:
        """Outputs for ``feeds``, split into micro-batches and pipelined (like ORT's ``run``)."""
        known = [o.name for o in self.plan.outputs]
        inputs = [i.name for i in self.plan.inputs]
        names = list(output_names) if output_names else known
        unknown = [n for n in names if n not in known]
        if unknown:
            raise PartitionError(f"unknown output {unknown[0]!r}; outputs: {known}")
        missing = [n for n in inputs if n not in feeds]
        if missing:
            raise PartitionError(f"missing input {missing[0]!r}; inputs: {inputs}")
        fixed = microbatch.batch_axes(self.plan)
        try:
            batches = microbatch.split(dict(feeds), self.microbatches, fixed)
        except ValueError as exc:
            raise PartitionError(str(exc)) from None
        parts = self.run_microbatches(batches)
        merged = microbatch.merge([{n: p[n] for n in names} for p in parts], fixed)
        return [merged[n] for n in names]

    def run_microbatches(self, batches: Sequence[Mapping[str, np.ndarray]]) -> list[Env]:
        """Stream ``batches`` through the pipeline; one output dict per batch, in order."""
        if not self._finalizer.alive:
            raise PartitionError("this PipelineSession is closed")
        count = len(batches)
        done: queue.SimpleQueue[Item | _Failed] = queue.SimpleQueue()
        busy_before, cpu_before = dict(self._busy), dict(self._cpu)
        began = time.perf_counter()
        first = self._inbox[0]
        for m, batch in enumerate(batches):
            first[replica_of(m, len(first))].put((done, m, dict(batch)))
        results: dict[int, Env] = {}
        deadline = began + self.timeout_s
        while len(results) < count:
            try:
                item = done.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                raise StageFailed(f"pipeline timed out after {self.timeout_s:.0f} s") from None
            if isinstance(item, _Failed):
                raise StageFailed(item.text) from item.cause
            results[item[0]] = item[1]
        self.last_stats = RunStats(
            wall_ms=(time.perf_counter() - began) * 1000.0,
            microbatches=count,
            busy_ms={k: (v - busy_before.get(k, 0.0)) * 1000.0 for k, v in self._busy.items()},
            cpu_ms={k: (v - cpu_before.get(k, 0.0)) * 1000.0 for k, v in self._cpu.items()},
        )
        return [results[m] for m in range(count)]

    def close(self) -> None:
        """Stop the workers (idempotent; also done when the session is garbage-collected)."""
        self._finalizer()

    def __enter__(self) -> PipelineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(
    stage: StageSession,
    inboxes: list[list[queue.SimpleQueue[Task | None]]],
    keep: list[set[str]],
    busy: dict[tuple[int, int], float],
    cpu: dict[tuple[int, int], float],
) -> None:
    """A worker: take (reply queue, micro-batch, tensors) tasks until told to stop.

    It holds no reference to its session object, so an unused session can be collected.
    """
    k, r = stage.index, stage.replica
    inbox, last = inboxes[k][r], k + 1 == len(inboxes)
    while True:
        task = inbox.get()
        if task is None:
            return
        done, m, env = task
        began, began_cpu = time.perf_counter(), time.thread_time()
        try:
            values = stage.session.run(stage.outputs, {n: env[n] for n in stage.inputs})
        except Exception as exc:  # onnxruntime raises its own types; report and keep serving
            text = one_line(exc)
            done.put(_Failed(f"stage {k} replica {r} ({stage.device}) failed: {text}", exc))
            continue
        finally:
            busy[(k, r)] += time.perf_counter() - began
            cpu[(k, r)] += time.thread_time() - began_cpu
        env.update(zip(stage.outputs, values))
        env = {n: v for n, v in env.items() if n in keep[k]}
        if last:
            done.put((m, env))
        else:
            nxt = inboxes[k + 1]
            nxt[replica_of(m, len(nxt))].put((done, m, env))


def _shutdown(
    inboxes: list[list[queue.SimpleQueue[Task | None]]], threads: list[threading.Thread]
) -> None:
    for replicas in inboxes:
        for inbox in replicas:
            inbox.put(None)
    for thread in threads:
        thread.join(timeout=10)
