"""What ``export --hf-config`` is asked for: the defaults of a Hugging Face export, written once."""

from __future__ import annotations

__all__ = ["DEFAULT_SEQ_LEN"]

#: ``--seq-len`` when not given: the static sequence dimension of the export.
DEFAULT_SEQ_LEN = 1024
