"""The cached train profile that prices a train plan for the CPU at hand by default
(``partition --mode train`` without ``--costs`` or ``--analytic``): ``profile --mode train`` of
the model on this CPU, written once into the profile cache (:func:`~.cache.cache_folder`) under
a name derived from everything that shapes its times (:func:`profile_key`), and read back by
every later plan of the same model at the same shapes on the same machine, so the same command
gives the same plan. Deleting the file measures again."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from onnx_partition.cost.profile.cache import cache_folder
from onnx_partition.fileio import sha256_file

__all__ = [
    "PRICINGS",
    "PRICING_ENV",
    "REPEATS",
    "cached_train_profile",
    "cpu_name",
    "profile_key",
    "profile_path",
]

#: The environment variable that sets the default pricing of a train plan for this CPU:
#: ``measured`` (the default) or ``analytic`` (as ``--analytic``; a shared CI runner, say).
PRICING_ENV = "ONNX_PARTITION_TRAIN_PRICING"
PRICINGS = ("measured", "analytic")
#: Timed repetitions of the default profile (``profile --mode train --repeats``).
REPEATS = 10
#: Bump when profiles measured before are no longer what a plan should be priced by.
VERSION = 2  # 2: CPU profiles in thread CPU time


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(model: Path, *, input_shapes: Mapping[str, Sequence[int]] | None,
                batch_size: int | None, precision: str, threads: int = 1,
                repeats: int = REPEATS) -> dict[str, Any]:
    """What the cached profile of ``model`` depends on: the ONNX file's and its program's
    contents (sha256), the shapes as asked, the precision, threads and repeats, and the
    machine (CPU model and count, architecture) and torch that measure it."""
    import torch

    program = model.with_suffix(".pt2")
    return {"version": VERSION, "model": sha256_file(model), "program": sha256_file(program),
            "input_shapes": {k: list(v) for k, v in sorted((input_shapes or {}).items())},
            "batch_size": batch_size, "precision": precision, "threads": threads,
            "repeats": repeats, "cpu": cpu_name(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "torch": torch.__version__}


def profile_path(key: Mapping[str, Any], cache_dir: Path | None = None) -> Path:
    """Where the profile of ``key`` lives in the cache folder."""
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_folder(cache_dir) / f"train-{tag}.json"


def cached_train_profile(key: Mapping[str, Any], measure: Callable[[Path], None], *,
                         cache_dir: Path | None = None) -> tuple[Path, bool]:
    """The cached profile of ``key`` and whether it was there already; where it is not,
    ``measure(path)`` writes it (atomically: a concurrent plan reads a whole file or none)."""
    path = profile_path(key, cache_dir)
    if path.is_file():
        return path, True
    path.parent.mkdir(parents=True, exist_ok=True)
    measure(path)
    return path, False
