"""What an inference rank's memory held, measured in the run: onnxruntime allocates its
weights, arena and activations itself, where no tracker of torch's storages
(:mod:`onnx_partition.runtime.memtrack`) sees them, so a rank measures its process instead.

* ``resident_bytes``: the peak resident set over the rank's run (``VmHWM`` of
  ``/proc/self/status``, first reset to the current resident set by writing ``5`` to
  ``/proc/self/clear_refs``, Linux 4.0+): all the process holds, the interpreter, torch and
  onnxruntime's libraries (shared with the fork server) included.
* ``memory_bytes``: that peak less the resident set when the rank started, before its stage's
  session was built: what the stage itself made resident (its weights, onnxruntime's arena
  and activations, the wire's buffers), the peak as the pages touched, freed memory the
  allocator kept included. None where the peak cannot be reset (``resident_bytes`` is then
  the peak since the process started, as a training rank's is).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ResidentPeak", "reset_peak", "status_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(field: str, status: Path = _STATUS) -> int | None:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``: kB) in bytes, None where the
    file or the field is not there."""
    try:
        text = status.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * (1024 if len(parts) < 3 or parts[2] == "kB" else 1)
    return None


def reset_peak(clear_refs: Path = _CLEAR_REFS) -> bool:
    """Reset this process's peak resident set (``VmHWM``) to its current one; False where
    the kernel does not let it."""
    try:
        clear_refs.write_text("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ResidentPeak:
    """The resident set when a rank started (``start_bytes``; None where its peak could not
    be reset), read again at its end (:meth:`reading`)."""

    start_bytes: int | None

    @classmethod
    def start(cls) -> ResidentPeak:
        """The peak reset and the resident set now."""
        return cls(status_bytes("VmRSS") if reset_peak() else None)

    def reading(self) -> tuple[int | None, int | None]:
        """(``memory_bytes``, ``resident_bytes``) since :meth:`start` (the module docstring)."""
        peak = status_bytes("VmHWM")
        if peak is None or self.start_bytes is None:
            return None, peak  # (unreset: the process's peak since it started)
        return max(0, peak - self.start_bytes), peak
