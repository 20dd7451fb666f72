"""What every measuring step shares: the measuring context (device, threads, session options,
clock), the settings it records, progress, timed repeats and random feeds.

Each measuring phase repeats ``repeats`` times but stops early after ``_BUDGET_S`` seconds once
``_MIN_RUNS`` runs are in (large models); :class:`MeasureSettings` records the runs made.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.graph import OpGraph
from onnx_partition.graph.ort import open_session, session_options

__all__ = ["Context", "MeasureSettings", "Progress", "Ticker", "input_feeds", "random_array",
           "repeat", "run_session"]

Progress = Callable[[int, int], None]

#: Soft time limit (seconds) of one measuring phase, once ``_MIN_RUNS`` timed runs are in.
_BUDGET_S = 10.0
_MIN_RUNS = 3
_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


@dataclass
class MeasureSettings:
    """What the measuring steps chose and how many runs they made; recorded in the ``settings``
    of costs.json (fields left None are not recorded)."""

    captured_values: int | None = None  # signature-model inputs captured from a whole-model run
    signature_model_error: str | None = None  # why the signature model fell back to "whole"
    method_used: str | None = None
    cuda_copies: int | None = None
    profile_optimization: str | None = None
    profiled_runs: int | None = None
    profiled_run_ms: float | None = None  # median profiled run
    unmatched_events: int | None = None
    folded_signatures: int | None = None
    measure_s: float | None = None
    whole_runs: int | None = None
    whole_s: float | None = None

    def recorded(self) -> dict[str, object]:
        """The fields that were set, by name."""
        return {f.name: value for f in fields(self)
                if (value := getattr(self, f.name)) is not None}


@dataclass
class Context:
    """What every measuring step needs, and the settings they record."""

    graph: OpGraph
    device: str
    cuda_id: int | None
    threads: int
    warmup: int
    repeats: int
    settings: MeasureSettings = field(default_factory=MeasureSettings)

    @property
    def clock(self) -> Callable[[], float]:
        """Thread CPU time on one CPU thread, else the wall clock (see :func:`repeat`)."""
        return time.thread_time if self.cuda_id is None and self.threads == 1 else time.perf_counter

    @property
    def providers(self) -> list[Any]:
        if self.cuda_id is None:
            return ["CPUExecutionProvider"]
        return [("CUDAExecutionProvider", {"device_id": self.cuda_id}), "CPUExecutionProvider"]

    def options(self, *, optimize: bool, profile_dir: str | None = None) -> ort.SessionOptions:
        opts = session_options(self.threads)
        if not optimize:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if profile_dir is not None:
            opts.enable_profiling = True
            opts.profile_file_prefix = os.path.join(profile_dir, "trace")
        if self.graph.path is not None:
            folder = str(Path(self.graph.path).resolve().parent)
            opts.add_session_config_entry(_EXTERNAL_FOLDER, folder)
        return opts

    def session(self, model: onnx.ModelProto, opts: ort.SessionOptions,
                what: str) -> ort.InferenceSession:
        try:
            return open_session(model.SerializeToString(), opts, self.providers,
                                f"{what} on {self.device}")
        except PartitionError:  # the provider it got is not the one asked for
            raise
        except Exception as exc:  # onnxruntime raises its own exception types
            first = one_line(exc)
            raise PartitionError(f"onnxruntime cannot load {what} on {self.device}: "
                                 f"{first}") from None


class Ticker:
    """Progress in runs done out of an upper bound; the bound is reached at the end."""

    def __init__(self, callback: Progress | None, total: int) -> None:
        self.callback, self.total, self.done = callback, max(total, 1), 0

    def tick(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def finish(self) -> None:
        self.tick(self.total - self.done)


def repeat(run: Callable[[], object], ctx: Context, ticker: Ticker) -> list[float]:
    """Warm up, then time ``run`` (ms) ``ctx.repeats`` times or until the budget is spent.

    On one CPU thread the run executes on the calling thread, and its CPU time
    (``time.thread_time``) is its run time without the time other processes took the core
    (the wall clock counts that too, and on a shared machine it skews the calibration).
    """
    clock = ctx.clock
    start = time.perf_counter()
    for i in range(ctx.warmup):
        if i and time.perf_counter() - start > _BUDGET_S / 4:
            ticker.tick(ctx.warmup - i)
            break
        run()
        ticker.tick()
    times: list[float] = []
    start = time.perf_counter()
    for i in range(ctx.repeats):
        if i >= _MIN_RUNS and time.perf_counter() - start > _BUDGET_S:
            ticker.tick(ctx.repeats - i)
            break
        t0 = clock()
        run()
        times.append((clock() - t0) * 1e3)
        ticker.tick()
    return times


def run_session(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray],
                what: str) -> None:
    """One run of ``session``; an onnxruntime failure becomes a PartitionError naming ``what``."""
    try:
        session.run(None, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        first = one_line(exc)
        raise PartitionError(f"onnxruntime failed to run {what}: {first}") from None


def input_feeds(graph: OpGraph, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the graph's concrete shapes and dtypes (integer index inputs in range)."""
    rng = np.random.default_rng(seed)
    bounds = graph.index_bounds
    feeds = {}
    for name in graph.inputs:
        ttype = graph.concrete_types.get(name) or graph.types.get(name)
        if ttype is None or not ttype.HasField("tensor_type") or not ttype.tensor_type.elem_type:
            raise PartitionError(f"input {name!r} is not a typed tensor; cannot profile it")
        dtype = helper.tensor_dtype_to_np_dtype(ttype.tensor_type.elem_type)
        feeds[name] = random_array(rng, dtype, graph.input_shapes[name], bounds.get(name, 2))
    return feeds


def random_array(rng: np.random.Generator, dtype: Any, shape: Sequence[int],
                 high: int) -> np.ndarray:
    """Uniform [0, 1) floats (no NaN from log/sqrt), booleans, or integers in [0, high)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(tuple(shape)) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, max(int(high), 1), size=tuple(shape)).astype(dtype)
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        return rng.random(tuple(shape)).astype(dtype)
    raise PartitionError(f"cannot make random inputs of dtype {dtype}")
