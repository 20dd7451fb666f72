"""The two error classes users see: bad input (:class:`PartitionError`, exit code 2 at the
command line) and a run that failed (:class:`StageFailed`, exit code 1); an exception as one
line (:func:`one_line`), and every JSON file read with one rule (:func:`read_json`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["PartitionError", "StageFailed", "one_line", "read_json"]


class PartitionError(Exception):
    """Bad input or an impossible request, explained in one line.

    The CLI prints ``error: <message>`` and exits with code 2; library callers catch it.
    """


class StageFailed(RuntimeError):
    """A stage or rank failed while running; the message names the stage and replica (and rank).

    Raised ``from`` the original exception where this process holds it (as torchgpipe's worker
    does), so ``__cause__`` keeps its type and traceback; a rank that failed in another process
    is known by its message only.
    """


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line (its ``repr`` when it has none),
    without the C++ source location torch and onnxruntime prefix; a line that ends in a colon
    (torch pipelining's "Failed to run stage backward input:") goes on with its cause's."""
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else repr(exc)
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    if line.endswith(":") and exc.__cause__ is not None:
        line = f"{line} {one_line(exc.__cause__)}"
    return line


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON in ``path``, or a PartitionError naming the ``what`` file that is missing or
    unreadable (``what``: "costs", "cluster", ...)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PartitionError(f"no such {what} file: {path}") from None
    except (OSError, ValueError) as exc:
        raise PartitionError(f"cannot read {what} file {path}: {exc}") from None
