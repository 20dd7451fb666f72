"""What a training rank measures besides the wall clock: the bytes a stage module saves for
backward (:class:`SavedCounter`, through autograd's saved-tensor hook) and the forward and
backward compute time of a step (:class:`Clock`: CPU time beside it on CPU, CUDA events on a
GPU)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

__all__ = ["Clock", "SavedCounter", "counting"]


class SavedCounter:
    """Bytes a stage module (and the loss after the last) saves for backward in one forward, as
    autograd keeps them: every
    tensor packed by ``torch.autograd.graph.saved_tensors_hooks`` counted once per storage
    (``StorageWeakRef``: views of one buffer, or a tensor saved by two ops, count once), the
    module's parameters and buffers left out; the rule of
    :func:`onnx_partition.cost.saved.saved_bytes`, which prices ``activation_bytes``, applied
    to the real run. ``active`` until the first step ends (the hook costs a little time)."""

    def __init__(self, module: torch.nn.Module) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._weights = {StorageWeakRef(t.untyped_storage())
                         for t in [*module.parameters(), *module.buffers()]}
        self.seen: set[Any] = set()  # the forward's storages (StorageWeakRef), weights too
        self.active = True
        self.per_microbatch: list[int] = []

    def start(self) -> None:
        self.seen = set(self._weights)
        self.per_microbatch.append(0)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = self._ref(storage)
        if key not in self.seen:
            self.seen.add(key)
            self.per_microbatch[-1] += int(storage.nbytes())
        # detached: a saved output packed as itself would hold its own node (a cycle through
        # C++ that only a backward without retain_graph breaks: ZB-H1's split passes retain it,
        # so the first step's graphs were never freed)
        return tensor.detach()


def counting(counter: SavedCounter | None) -> Any:
    """The saved-tensor hook around one forward while ``counter`` is active, else nothing."""
    if counter is None or not counter.active:
        return contextlib.nullcontext()
    counter.start()
    return torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)


class Clock:
    """Forward (0) and backward (1) compute time of a step. CPU: ``perf_counter`` around each
    action, and the thread's CPU time (``thread_time``) beside it. CUDA: a pair of events per
    action, read once at the step's end (one wait for the last event, not a whole-device
    synchronize around every action)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = [0.0, 0.0]
        self.cpu_seconds = [0.0, 0.0]
        self.events: list[tuple[int, Any, Any]] = []  # (kind, start, end), CUDA

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter(), time.thread_time()

    def stop(self, kind: int, began: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((kind, began, end))
        else:
            self.seconds[kind] += time.perf_counter() - began[0]
            self.cpu_seconds[kind] += time.thread_time() - began[1]

    def read(self) -> tuple[float, float]:
        """The step's (forward, backward) seconds; starts the next step at zero."""
        if self.events:
            self.events[-1][2].synchronize()
            for kind, began, end in self.events:
                self.seconds[kind] += began.elapsed_time(end) / 1000.0
            self.events.clear()
        fwd, bwd = self.seconds
        self.seconds = [0.0, 0.0]
        return fwd, bwd

    def read_cpu(self) -> tuple[float, float]:
        """The step's (forward, backward) CPU seconds of this thread (CPU only)."""
        fwd, bwd = self.cpu_seconds
        self.cpu_seconds = [0.0, 0.0]
        return fwd, bwd
