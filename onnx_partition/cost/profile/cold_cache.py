"""How much slower the whole program computes when it starts from cold caches, as a pipeline
rank's compute does: the factor ``profile --mode train`` records as its settings' ``cold_cache``.

``profile --mode train`` times the whole program in a tight loop: each forward and backward finds
the weights and activations the previous repeat left in the last-level cache. A pipeline rank
never runs so: every action follows a wait for its peer (``blocked in receives``: 20 of inception's
51 ms a step), during which the peer, the gloo threads and whatever else shares the machine's
last-level cache replace its lines, so each forward and backward starts by reading its weights
from memory again. :func:`measure_cold_cache` times the whole program's forward and backward in
thread CPU time (``time.thread_time``, as :mod:`.side_by_side` does) in two ways, round by round
in turn (so that drift in the machine's speed weighs on both alike):

* ``warm``: as the profile's loop runs it;
* ``cold``: after writing a buffer of :func:`eviction_bytes` (twice the largest CPU cache) before
  the forward and again before the backward.

The factor is cold over warm (medians), at least 1 (evicting the caches cannot make the compute
faster). Measured on a 2-core AMD EPYC VM (32 MiB shared L3; ``tools/bench_cold_cache.py``,
docs/benchmarks.md): inception 1.14 / 1.16 (forward / backward), resnet 1.08 / 1.07, gpt 1.02 /
1.00 -- the order in which their engine runs stretched past the uncalibrated price; evicting only
4 MiB (four L2s) or idling 3-10 ms without evicting costs 1.00-1.06. The factor depends on the
machine's moment: inception's measured 1.02-1.17 over one half hour (when the host's cache is
already under pressure from outside, warm is cold too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

__all__ = ["DEFAULT_CACHE_BYTES", "eviction_bytes", "measure_cold_cache"]

#: The largest cache when sysfs does not say (a server's last-level cache).
DEFAULT_CACHE_BYTES = 32 * 2**20
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def _size_bytes(text: str) -> int:
    """``32768K`` / ``32M`` / ``512`` (sysfs cache ``size``) in bytes; 0 if unreadable."""
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text and text[-1] in units:
            return int(text[:-1]) * units[text[-1]]
        return int(text)
    except ValueError:
        return 0


def eviction_bytes(caches: Path = _CACHES) -> int:
    """Twice the largest cache of CPU 0 (sysfs), or of :data:`DEFAULT_CACHE_BYTES`: a buffer
    that size, written, leaves none of what was cached before."""
    sizes = [_size_bytes(p.read_text()) for p in caches.glob("index*/size")] \
        if caches.is_dir() else []
    return 2 * (max(sizes, default=0) or DEFAULT_CACHE_BYTES)


def measure_cold_cache(forward: Callable[[], Any], backward: Callable[[Any], None], *,
                       repeats: int, warmup: int, evict: int | None = None) -> dict[str, Any]:
    """Thread CPU ms of ``forward()`` and of ``backward(forward's result)``, warm and after
    evicting the caches (``evict`` bytes written; default :func:`eviction_bytes`), ``warmup +
    repeats`` rounds each, in turn; the factor cold / warm per pass (medians), at least 1."""
    import torch

    size = evict if evict is not None else eviction_bytes()
    junk = torch.zeros(max(size // 4, 1), dtype=torch.float32)
    times: dict[str, tuple[list[float], list[float]]] = {"warm": ([], []), "cold": ([], [])}
    for i in range(warmup + repeats):
        for name in ("warm", "cold"):
            if name == "cold":
                junk.add_(1.0)
            began = time.thread_time()
            result = forward()
            forward_s = time.thread_time() - began
            if name == "cold":
                junk.add_(1.0)
            began = time.thread_time()
            backward(result)
            backward_s = time.thread_time() - began
            if i >= warmup:
                times[name][0].append(forward_s * 1e3)
                times[name][1].append(backward_s * 1e3)
    ms = {k: (median(f), median(b)) for k, (f, b) in times.items()}
    ratios = [c / w if w > 0 else 1.0 for w, c in zip(ms["warm"], ms["cold"], strict=True)]
    return {
        "forward": round(max(1.0, ratios[0]), 4),
        "backward": round(max(1.0, ratios[1]), 4),
        "evict_bytes": size,
        "source": (f"the whole program's thread CPU time after writing {size} bytes (twice the "
                   f"largest cache) over its time in the profile's tight loop, at least 1: "
                   f"medians of {repeats} rounds in turn"),
        "measured": {"forward": round(ratios[0], 4), "backward": round(ratios[1], 4)},
        "cpu_ms": {k: [round(v, 4) for v in ms[k]] for k in times},
    }
