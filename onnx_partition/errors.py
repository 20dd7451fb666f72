"""The one error class users see: a clear message, exit code 2 at the command line."""

from __future__ import annotations


class PartitionError(Exception):
    """Bad input or an impossible request, explained in one line.

    The CLI prints ``error: <message>`` and exits with code 2; library callers catch it.
    """
