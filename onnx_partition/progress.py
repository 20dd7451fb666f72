"""Progress bars for the long steps of the command line: tqdm on stderr, only on a terminal.

A bar shows done/total, rate and ETA. Off a terminal (a pipe, a log file, CI) nothing is drawn,
so captured output stays clean.

Library code reports a long loop to a :class:`Reporter` it is handed (``reporter=``, default
:data:`SILENT`); there is no global state. The command line hands it :class:`Bars`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from tqdm import tqdm

__all__ = ["SILENT", "Bars", "Reporter", "Silent", "echo", "iterate", "loss_bar",
           "progress_callback", "shown", "timed"]

T = TypeVar("T")


def shown(enabled: bool = True) -> bool:
    """Whether bars are drawn: asked for, and stderr is a terminal."""
    return enabled and sys.stderr.isatty()


def _bar(label: str, total: float | None, enabled: bool, **kw: Any) -> tqdm[Any]:
    return tqdm(total=total, desc=label, disable=not shown(enabled), leave=False,
                dynamic_ncols=True, file=sys.stderr, **kw)


def progress_callback(label: str, *, enabled: bool = True) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback (as :func:`profile_model` takes) driving a bar."""
    state: dict[str, tqdm[Any]] = {}

    def update(done: int, total: int) -> None:
        if total <= 0:
            return
        if "bar" not in state:
            state["bar"] = _bar(label, total, enabled, unit="step")
        bar = state["bar"]
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def loss_bar(label: str, total: int, *, start: int = 0,
             enabled: bool = True) -> Callable[[int, float], None]:
    """A ``update(done, loss)`` callback driving a bar of ``total`` steps (from ``start``: a
    resumed run) that shows the last loss beside the rate and ETA; closed at ``total``. Drawn in
    a training rank, so tqdm's lock there is a thread lock: its default, a multiprocessing lock,
    is a named semaphore that a rank ending in ``os._exit`` (a failed step, ^C) leaves behind,
    and the resource tracker warned of it under the run's one-line error."""
    tqdm.set_lock(threading.RLock())  # one process draws these bars; none shares them
    bar = _bar(label, total, enabled, unit="step", initial=start)

    def update(done: int, loss: float) -> None:
        bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def echo(text: str) -> None:
    """Print ``text`` (a line) on stdout, flushed, above this process's bars: tqdm clears them,
    writes, and draws them again below (a plain print lands on the bar's own line)."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def iterate(items: Iterable[T], label: str, *, total: int | None = None,
            enabled: bool = True) -> Iterator[T]:
    """``items`` with a bar over them (run and train iterations)."""
    bar = _bar(label, total, enabled, unit="it")
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()


@contextmanager
def timed(label: str, seconds: float, *, enabled: bool = True) -> Iterator[None]:
    """A bar that fills over ``seconds`` of wall time while the block runs: for a step bounded
    by a time limit (the ILP), whose ETA is that limit."""
    bar = _bar(label, round(seconds, 1), enabled, unit="s",
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
                          "[{elapsed}<{remaining}, time limit]")
    done = threading.Event()

    def tick() -> None:
        began = time.monotonic()
        while not done.wait(0.5):
            bar.n = min(time.monotonic() - began, seconds)
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    if not bar.disable:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread.is_alive():
            thread.join()
        bar.close()


class Reporter(Protocol):
    """Where library code reports its long loops (export, writing stage files, planning)."""

    def step(self, label: str, done: int, total: int) -> None:
        """``done`` of ``total`` for the loop named ``label``."""


class Silent:
    """A reporter that shows nothing (the default of every library call)."""

    def step(self, label: str, done: int, total: int) -> None:
        pass


#: The default reporter: nothing shown.
SILENT = Silent()


class Bars:
    """A reporter drawing a bar per label (:func:`progress_callback`: on a terminal, when
    ``enabled``); a label's bar starts over when ``done`` goes back."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bars: dict[str, tuple[Callable[[int, int], None], int]] = {}  # label: (bar, last)

    def step(self, label: str, done: int, total: int) -> None:
        bar, last = self._bars.get(label, (None, -1))
        if bar is None or done <= last:
            bar = progress_callback(label, enabled=self.enabled)
        self._bars[label] = (bar, done)
        bar(done, total)
