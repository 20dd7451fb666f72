"""The on-disk cache of signature times: one JSON file per measuring context."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from onnx_partition.fileio import atomic_write

__all__ = ["CACHE_ENV", "METHOD_VERSION", "Cache", "cache_folder"]

#: Environment variable overriding the default cache folder.
CACHE_ENV = "ONNX_PARTITION_CACHE"
#: Bump when measurements are no longer comparable with cached ones.
METHOD_VERSION = 1


def cache_folder(cache_dir: Path | None) -> Path:
    """``cache_dir``, else ``$ONNX_PARTITION_CACHE``, else ``~/.cache/onnx-partition/profiles``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "onnx-partition" / "profiles"


class Cache:
    """Signature -> ms for one context (device, onnxruntime, threads, ...), one JSON file.

    Best effort: an unreadable or unwritable cache is ignored; writes merge and replace
    atomically (:func:`onnx_partition.fileio.atomic_write`), so concurrent profilers at worst
    lose each other's new entries.
    """

    def __init__(self, folder: Path, context: Mapping[str, object]) -> None:
        tag = hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()[:20]
        self.path: Path | None = folder / f"{tag}.json"
        self.context = dict(context)
        self.values = self._read()

    def _read(self) -> dict[str, float]:
        if self.path is None:
            return {}
        try:
            body = json.loads(self.path.read_text())
            return {str(k): float(v) for k, v in body["values"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def get(self, key: str) -> float | None:
        return self.values.get(key)

    def put(self, values: Mapping[str, float]) -> None:
        if not values or self.path is None:
            return
        merged = {**self._read(), **self.values, **values}
        self.values = merged
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps({"context": self.context, "values": merged}))
        except OSError:
            pass
