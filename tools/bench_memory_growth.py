"""Does the CPU memory tracker count everything that grows? A train plan run at few and at many
micro-batches per step: each stage's growth in the tracker's peak of live tensor storages
(:mod:`onnx_partition.runtime.memtrack`) against its growth in the ranks' peak resident set
(VmHWM, a fresh set of processes per run) and in glibc's live bytes (``mallinfo2``: handed out
and not freed, the most seen after a forward action), and their ratios. Under GPipe a stage
holds every micro-batch's activations at once, so all grow by ``M`` micro-batches' worth: a
tracker that missed storages (an under-count) shows a ratio under 1 against both. Issue 33's
bar: within 10%.

``--allocator returning`` runs the ranks with ``MALLOC_MMAP_THRESHOLD_=131072`` (the process is
started again with it): glibc then maps every block of 128 KiB or more apart and unmaps it when
freed, so freed memory leaves the resident set at once. By default (``glibc``) its mmap
threshold rises to the largest block freed (up to 32 MiB), tensors come from the heap, and
freed holes stay resident: VmHWM then grows by more than what lives. ``--trim`` calls glibc's
``malloc_trim(0)`` after each forward action (freed pages inside the heap handed back). Other
glibc settings go in the environment (``MALLOC_ARENA_MAX=1 ... bench_memory_growth.py``).

    .venv/bin/python tools/bench_memory_growth.py PLAN [--microbatches 4 32]
        [--schedules gpipe 1f1b] [--steps 2] [--allocator glibc|returning] [--trim]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.trainer import train_plan

MB = 1e6
RETURNING = {"MALLOC_MMAP_THRESHOLD_": "131072"}


class _Info(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_in_use() -> int | None:
    """glibc's live bytes (``uordblks + hblkhd``, over every arena); None without glibc 2.33+."""
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _Info
    got = info()
    return int(got.uordblks + got.hblkhd)


class InUsePeak:
    """A rank hook: after each forward action, the most of :func:`malloc_in_use` seen so far,
    written to ``{prefix}.{rank}`` (``trim``: ``malloc_trim(0)`` first)."""

    def __init__(self, prefix: str, trim: bool = False) -> None:
        self.prefix, self.peak, self.trim = prefix, 0, trim

    def __call__(self, rank: int, point: str) -> None:
        if point == "forward":
            if self.trim:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            self.peak = max(self.peak, malloc_in_use() or 0)
            Path(f"{self.prefix}.{rank}").write_text(json.dumps(self.peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--microbatches", type=int, nargs=2, default=[4, 32])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--allocator", choices=["glibc", "returning"], default="glibc")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each forward")
    args = parser.parse_args()
    if args.allocator == "returning" and any(os.environ.get(k) != v
                                             for k, v in RETURNING.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **RETURNING})
    plan = read_plan(args.plan)
    low, high = args.microbatches
    settings = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    print(f"{args.plan}: {len(plan.stages)} stages, {plan.rows_per_microbatch} rows per "
          f"micro-batch, {args.steps} steps, M={low}->{high}; allocator {args.allocator} "
          f"({settings or 'glibc defaults'}{', malloc_trim after each forward' * args.trim}); "
          f"{os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n| schedule | stage | tracker peak MB (M low / high) | VmHWM MB (low / high) | "
          "tracker growth MB | malloc live growth MB | VmHWM growth MB | tracker / malloc | "
          "tracker / VmHWM |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as scratch:
        for schedule in args.schedules:
            _rows(args.plan, schedule, (low, high), args.steps, len(plan.stages),
                  f"{scratch}/{schedule}", args.trim)


def _rows(plan: Path, schedule: str, counts: tuple[int, int], steps: int, stages: int,
          scratch: str, trim: bool) -> None:
    """Run ``schedule`` at both counts and print a row per stage."""
    runs, in_use = {}, {}
    for count in counts:
        prefix = f"{scratch}-{count}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a schedule other than the plan's
            runs[count] = train_plan(plan, steps=steps, microbatches=count, schedule=schedule,
                                     hook=InUsePeak(prefix, trim))
        in_use[count] = [_read(f"{prefix}.{r}") for r in range(stages)]  # a rank per stage
    low, high = counts
    for k in range(stages):
        peak = [runs[c].memory_bytes[k] or 0 for c in counts]
        resident = [runs[c].resident_bytes[k] or 0 for c in counts]
        tracked, held = peak[1] - peak[0], resident[1] - resident[0]
        live = in_use[high][k] - in_use[low][k]
        print(f"| {schedule} | {k} | {peak[0] / MB:.1f} / {peak[1] / MB:.1f} | "
              f"{resident[0] / MB:.1f} / {resident[1] / MB:.1f} | {tracked / MB:+.1f} | "
              f"{live / MB:+.1f} | {held / MB:+.1f} | {_ratio(tracked, live)} | "
              f"{_ratio(tracked, held)} |", flush=True)


def _read(path: str) -> int:
    return int(json.loads(Path(path).read_text())) if Path(path).exists() else 0


def _ratio(part: int, whole: int) -> str:
    return f"**{part / whole:.3f}**" if whole > 0 else "-"


if __name__ == "__main__":
    main()
