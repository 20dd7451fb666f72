"""Workers that never outlive their launcher, and a launcher that knows which worker went silent.

Any launcher of worker processes (``run --nproc``, ``train``) uses the same three pieces:

* :func:`die_with` (in each worker, first thing): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the
  kernel kill the worker when its parent dies (the fork server, itself guarded the same way by
  :func:`guard_fork_server`), and a watchdog thread blocks on a ``pidfd`` of the launcher (or
  polls ``/proc`` where there is none) and kills the worker when the launcher is gone, also when
  the launcher is a zombie that nobody reaped. The resource tracker then exits by itself: it
  stops when the last process holding its pipe is gone.
* :class:`Heartbeats`: one shared float per worker, the ``time.monotonic()`` of its last beat,
  written every :data:`BEAT_S` seconds by a thread of the worker (:meth:`Heartbeats.start`);
  onnxruntime and gloo release the GIL, so a busy worker still beats, and a stopped (SIGSTOP)
  or hung one does not.
* :meth:`Heartbeats.silent`: the launcher's poll names the workers whose last beat is older than
  a limit, so a stall is reported by the stalled worker's name, not by a peer's timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
import time
from typing import Any

__all__ = ["BEAT_S", "Heartbeats", "die_with", "guard_fork_server"]

BEAT_S = 0.25  # seconds between heartbeats
_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in (b"Z", b"X")


def _watch(launcher: int, poll_s: float) -> None:
    fd = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(launcher)  # readable once the launcher has exited
    while _alive(launcher):
        if fd is not None:
            if select.select([fd], [], [], poll_s)[0]:
                break
        else:
            time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with(launcher: int, *, poll_s: float = 1.0) -> None:
    """Make this worker die with its launcher (pid ``launcher``): a parent-death signal, and a
    watchdog thread on the launcher's pid (the launcher may be a grandparent). Call first thing
    in the worker."""
    _set_parent_death_signal()
    if os.getppid() != launcher and not _alive(launcher):  # gone before we got here
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch, args=(launcher, poll_s), daemon=True,
                     name="lifeline").start()


def guard_fork_server() -> None:
    """In a multiprocessing fork server (import time of a preloaded module): die with the
    process that started it. Does nothing in any other process."""
    import multiprocessing

    if multiprocessing.current_process().name == "MainProcess" and _is_fork_server():
        _set_parent_death_signal()


def _is_fork_server() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            return b"multiprocessing.forkserver" in handle.read()
    except OSError:
        return False


class Heartbeats:
    """A shared array of last-beat times, one per worker (see the module docstring)."""

    def __init__(self, context: Any, count: int) -> None:
        self.times = context.RawArray("d", count)  # 0.0: not started yet

    def start(self, index: int) -> None:
        """In worker ``index``: beat every :data:`BEAT_S` seconds from a daemon thread."""
        times = self.times

        def beat() -> None:
            while True:
                times[index] = time.monotonic()
                time.sleep(BEAT_S)

        times[index] = time.monotonic()
        threading.Thread(target=beat, daemon=True, name="heartbeat").start()

    def silent(self, limit_s: float, running: list[bool]) -> dict[int, float]:
        """Workers still running whose last beat is older than ``limit_s``: index -> seconds
        since it."""
        now = time.monotonic()
        return {i: now - t for i, t in enumerate(self.times)
                if running[i] and t > 0.0 and now - t > limit_s}
