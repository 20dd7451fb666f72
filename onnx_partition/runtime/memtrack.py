"""What a rank's memory held, measured in the run: the peak of the bytes of every live tensor
storage it allocated (parameters, gradients, optimizer state, activations, communication
buffers, temporaries), beside the process's peak resident set and, on CUDA, the allocator's
reserve.

* **CUDA**: the caching allocator keeps the peak: ``torch.cuda.max_memory_allocated`` (reset
  when tracking starts) and ``max_memory_reserved`` (``reserved_bytes``).
* **CPU**: no allocator keeps one, so :class:`StorageTracker` counts it: a
  ``TorchDispatchMode`` sees every op's outputs, adds each new storage's ``nbytes`` once
  (keyed by its ``data_ptr``: views and in-place results add nothing) and a ``weakref``
  finalizer on the storage takes it off when the storage is freed (torch keeps one Python
  object per storage while any tensor holds it, so the finalizer runs at the storage's own
  free). Storages made before tracking starts (the parameters, a loaded optimizer state) are
  adopted (:meth:`StorageTracker.adopt`); so is every op's input whose storage no op made
  (``torch.from_numpy`` of the data's rows, whose only op is a view; a tensor made before
  tracking or on another thread), at its first use: before, a rank reading a data file did
  not count its batch. Chosen over torch's memory profiler
  (``torch.profiler.profile(profile_memory=True)``): that records an event per allocation for
  the whole run (memory and time growing with the steps) and gives the peak only after a
  timeline is rebuilt from them; the mode keeps two integers and a finalizer per storage.
  What it cannot see: memory outside torch's tensors (the interpreter, libraries, gloo's own
  buffers) and freed memory glibc keeps resident (its heap's holes: VmHWM's growth with the
  micro-batches held is 1.3x the live storages' under glibc's defaults, 1.04x when freed
  blocks are unmapped; the tracker's growth is 0.96-0.98 of malloc's own live count,
  docs/benchmarks.md), which ``resident_bytes`` includes.
* **The run's own copies** (:func:`host_copies`: what ``--check`` keeps of a rank's parameters
  and gradients to compare) are made with the tracker's mode off: they are the check's, not the
  plan's (on CUDA they are host copies, outside the allocator's count, likewise).
* ``resident_bytes``: ``VmHWM`` of ``/proc/self/status`` (the process's peak resident set
  since it started; None where the file is not there).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemoryReading", "StorageTracker", "Tracking", "host_copies", "resident_bytes",
           "tracking"]


@dataclass(frozen=True)
class MemoryReading:
    """A rank's memory over a tracked span: ``peak_bytes`` of live tensor storages,
    ``resident_bytes`` (VmHWM; None where not available), ``reserved_bytes`` (CUDA's
    allocator reserve; None elsewhere)."""

    peak_bytes: int
    resident_bytes: int | None
    reserved_bytes: int | None


def resident_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """The process's peak resident set (``VmHWM``, in bytes), None where not available."""
    try:
        text = status.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                scale = 1024 if len(parts) < 3 or parts[2].lower() == "kb" else 1
                return int(parts[1]) * scale
    return None


ACTIVE: list[StorageTracker] = []  # the trackers entered, innermost last


class StorageTracker:
    """Live and peak bytes of the CPU tensor storages made while it is entered (each storage
    counted once, released when freed); :meth:`adopt` counts storages made before."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, _Ref] = {}  # data_ptr -> a live counted storage
        self._lock = threading.Lock()  # a storage may be freed on another thread
        self._mode: _Mode | None = None

    def adopt(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count the storages of ``tensors`` (None and already counted ones skipped)."""
        for t in tensors:
            if t is not None:
                self._add(t)

    def reset_peak(self) -> None:
        """Start the peak again from what is live now."""
        self.peak = self.live

    def __enter__(self) -> StorageTracker:
        ACTIVE.append(self)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None
        ACTIVE.remove(self)

    def _add(self, t: torch.Tensor) -> None:
        if not t.is_cpu or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self._refs:
            return
        ref = _Ref(storage, self._free)
        ref.ptr, ref.size = ptr, storage.nbytes()
        with self._lock:
            self._refs[ptr] = ref
            self.live += ref.size
            if self.live > self.peak:
                self.peak = self.live

    def _free(self, ref: _Ref) -> None:
        ptr, size = ref.ptr, ref.size
        with self._lock:
            if self._refs.get(ptr) is ref:
                del self._refs[ptr]
                self.live -= size


class _Ref(weakref.ref[torch.UntypedStorage]):
    """A weak reference to a counted storage, with its address and size."""

    __slots__ = ("ptr", "size")
    ptr: int
    size: int


class _Mode(TorchDispatchMode):
    """Every op's outputs to the tracker."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # the inputs first: a storage made where no op saw it (torch.from_numpy of the data,
        # a tensor made before tracking or on another thread) is counted at its first use
        _visit(args, self.tracker._add)
        if kwargs:
            _visit(kwargs.values(), self.tracker._add)
        out = func(*args, **kwargs)
        if func.is_view:  # the output shares its input's storage
            return out
        if isinstance(out, torch.Tensor):
            self.tracker._add(out)
        elif isinstance(out, (tuple, list)):
            _visit(out, self.tracker._add)
        return out


def _visit(values: Iterable[Any], add: Any) -> None:
    """``add`` every tensor in ``values`` and in its tuples and lists (an op's arguments and
    results nest one level: ``cat``'s inputs, ``_foreach`` ops' lists)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            add(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    add(x)


class Tracking:
    """What :func:`tracking` yields: called, the :class:`MemoryReading` so far; :meth:`stop`
    ends the measuring (a CPU tracker's mode leaves the dispatch: every op after it runs at
    full speed) and keeps the peak it reached."""

    def __init__(self, peak: Callable[[], tuple[int, int | None]],
                 stop: Callable[[], None] | None = None) -> None:
        self._peak, self._stop = peak, stop
        self._kept: tuple[int, int | None] | None = None

    def __call__(self) -> MemoryReading:
        peak, reserved = self._kept if self._kept is not None else self._peak()
        return MemoryReading(peak, resident_bytes(), reserved)

    def stop(self) -> None:
        """Stop measuring (once; later calls change nothing)."""
        if self._kept is None:
            self._kept = self._peak()
            if self._stop is not None:
                self._stop()


@contextmanager
def tracking(device: torch.device, held: Iterable[torch.Tensor | None] = ()
             ) -> Iterator[Tracking]:
    """Track the memory of what runs inside (until the :class:`Tracking` it yields is stopped).
    ``held``: what already lives (parameters, buffers, optimizer state), adopted on CPU
    (CUDA's allocator counts it already)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield Tracking(lambda: (int(torch.cuda.max_memory_allocated(device)),
                                int(torch.cuda.max_memory_reserved(device))))
        return
    tracker = StorageTracker()
    tracker.adopt(held)
    tracker.__enter__()
    handle = Tracking(lambda: (tracker.peak, None), lambda: tracker.__exit__(None, None, None))
    try:
        yield handle
    finally:
        handle.stop()


def host_copies(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``named`` tensors that no tracker counts (the module docstring:
    a check's copies)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return {n: t.detach().cpu().clone() for n, t in named}
