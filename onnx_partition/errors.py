"""The one error class users see: a clear message, exit code 2 at the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class PartitionError(Exception):
    """Bad input or an impossible request, explained in one line.

    The CLI prints ``error: <message>`` and exits with code 2; library callers catch it.
    """


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
