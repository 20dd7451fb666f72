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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan
from onnx_partition.runtime import microbatch
from onnx_partition.runtime.stages import Provider, StageSession, load_stages

Env = dict[str, np.ndarray]
Item = tuple[int, Env]  # (micro-batch index, the tensors it carries)
_POLL_S = 0.05


class StageFailed(RuntimeError):
    """A stage worker raised; the message names the stage and replica."""


@dataclass
class RunStats:
    """Measurements of the last :meth:`PipelineSession.run`."""

    wall_ms: float = 0.0
    microbatches: int = 0
    busy_ms: dict[tuple[int, int], float] = field(default_factory=dict)  # (stage, replica)

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
        microbatches: int = 4,
        threads_per_stage: int = 1,
        timeout_s: float = 600.0,
    ) -> None:
        self.plan: Plan
        self.plan, self.stages = load_stages(
            plan_dir, providers=providers, threads_per_stage=threads_per_stage
        )
        self.microbatches = microbatches
        self.timeout_s = timeout_s
        self.last_stats = RunStats()
        # Names still needed after stage k: later stages' inputs and the graph outputs.
        outputs = [o.name for o in self.plan.outputs]
        self._keep: list[set[str]] = []
        for k in range(len(self.stages)):
            later = {n for s in self.plan.stages[k + 1:] for n in s.inputs}
            self._keep.append(later | set(outputs))

    def get_inputs(self) -> list[str]:
        return [spec.name for spec in self.plan.inputs]

    def get_outputs(self) -> list[str]:
        return [spec.name for spec in self.plan.outputs]

    def run(
        self, output_names: Sequence[str] | None, feeds: Mapping[str, np.ndarray]
    ) -> list[np.ndarray]:
        """Outputs for ``feeds``, split into micro-batches and pipelined (like ORT's ``run``)."""
        names = list(output_names) if output_names else self.get_outputs()
        unknown = [n for n in names if n not in self.get_outputs()]
        if unknown:
            raise PartitionError(f"unknown output {unknown[0]!r}; outputs: {self.get_outputs()}")
        missing = [n for n in self.get_inputs() if n not in feeds]
        if missing:
            raise PartitionError(f"missing input {missing[0]!r}; inputs: {self.get_inputs()}")
        parts = self.run_microbatches(microbatch.split(dict(feeds), self.microbatches))
        merged = microbatch.merge([{n: p[n] for n in names} for p in parts])
        return [merged[n] for n in names]

    def run_microbatches(self, batches: Sequence[Mapping[str, np.ndarray]]) -> list[Env]:
        """Stream ``batches`` through the pipeline; one output dict per batch, in order."""
        count = len(batches)
        inbox: list[list[queue.SimpleQueue[Item]]] = [
            [queue.SimpleQueue() for _ in replicas] for replicas in self.stages
        ]
        done: queue.SimpleQueue[Item] = queue.SimpleQueue()
        stop = threading.Event()
        errors: list[str] = []
        stats = RunStats(microbatches=count)

        def worker(stage: StageSession, todo: int) -> None:
            k, r = stage.index, stage.replica
            busy = 0.0
            try:
                for _ in range(todo):
                    item = _get(inbox[k][r], stop)
                    if item is None:
                        return
                    m, env = item
                    began = time.perf_counter()
                    values = stage.session.run(stage.outputs, {n: env[n] for n in stage.inputs})
                    busy += time.perf_counter() - began
                    env.update(zip(stage.outputs, values))
                    env = {n: v for n, v in env.items() if n in self._keep[k]}
                    if k + 1 < len(self.stages):
                        nxt = inbox[k + 1]
                        nxt[m % len(nxt)].put((m, env))
                    else:
                        done.put((m, env))
            except Exception as exc:
                errors.append(f"stage {k} replica {r} ({stage.device}) failed: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
                stop.set()
            finally:
                stats.busy_ms[(k, r)] = busy * 1000.0

        threads = []
        for replicas in self.stages:
            for stage in replicas:
                todo = len(range(stage.replica, count, len(replicas)))
                threads.append(threading.Thread(target=worker, args=(stage, todo), daemon=True,
                                                 name=f"stage{stage.index}.{stage.replica}"))
        began = time.perf_counter()
        for t in threads:
            t.start()
        for m, batch in enumerate(batches):
            inbox[0][m % len(inbox[0])].put((m, dict(batch)))
        results: dict[int, Env] = {}
        deadline = began + self.timeout_s
        try:
            while len(results) < count:
                if stop.is_set():
                    break
                if time.perf_counter() > deadline:
                    errors.append(f"pipeline timed out after {self.timeout_s:.0f} s")
                    break
                try:
                    m, env = done.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                results[m] = env
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
        stats.wall_ms = (time.perf_counter() - began) * 1000.0
        self.last_stats = stats
        if errors:
            raise StageFailed(errors[0])
        return [results[m] for m in range(count)]


def _get(inbox: queue.SimpleQueue[Item], stop: threading.Event) -> Item | None:
    while not stop.is_set():
        try:
            return inbox.get(timeout=_POLL_S)
        except queue.Empty:
            continue
    return None
