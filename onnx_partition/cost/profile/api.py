"""The entry points: profile a graph (:func:`profile_model`), write costs.json
(:func:`save_profile`), or both from a model file (:func:`profile_to_file`)."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime as ort

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import write_costs
from onnx_partition.cost.costs_file import provenance
from onnx_partition.cost.profile.cache import METHOD_VERSION, Cache, cache_folder
from onnx_partition.cost.profile.cpu import node_overhead
from onnx_partition.cost.profile.harness import Context, Progress, Ticker
from onnx_partition.cost.profile.measure import measure, time_whole
from onnx_partition.cost.profile.node_costs import SignatureTimes, calibrate
from onnx_partition.cost.profile.signatures import model_digest, signature_groups, signatures
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load
from onnx_partition.values import device_index

__all__ = ["ProfileResult", "parse_device", "profile_model", "profile_to_file", "save_profile"]


@dataclass(frozen=True)
class ProfileResult:
    """Calibrated per-node times (node key -> ms; free nodes excluded) and how they were got."""

    forward_ms: dict[str, float]
    backward_ms: dict[str, float]
    whole_model_ms: float  # median unprofiled end-to-end time
    raw_sum_ms: float  # sum of the raw per-node times (profiler events) before calibration
    device: str
    onnxruntime: str
    settings: dict[str, object]
    unique_signatures: int  # signatures measured by this call
    reused: int  # nodes served by another node's measurement or by the cache
    # fingerprint, input_shapes, batch_size, device_kind, device_name (cost.costs_file)
    provenance: dict[str, object] = field(default_factory=dict)


def profile_model(
    graph: OpGraph,
    *,
    device: str = "cpu",
    repeats: int = 20,
    warmup: int = 3,
    threads: int = 1,
    cache_dir: Path | None = None,
    backward_ratio: Mapping[str, float] | None = None,
    progress: Progress | None = None,
    method: str = "signatures",
) -> ProfileResult:
    """Measure every compute node of ``graph`` on ``device`` (``cpu`` or ``cuda:N``).

    ``backward_ratio`` overrides the backward/forward ratio per op type (default 2 for
    MatMul/Gemm/Conv-like ops, 1 otherwise, as in :func:`analytic.backward_ms`).
    ``progress(done, total)`` is called as runs complete. ``method`` is ``"signatures"``
    (default) or ``"whole"`` (see the package docstring).
    """
    name, cuda_id = parse_device(device)
    ratios = _checked_ratios(repeats, warmup, threads, method, backward_ratio)
    ctx = Context(graph, name, cuda_id, threads, warmup, repeats)
    sigs = signatures(graph)
    cache = Cache(cache_folder(cache_dir), {
        "version": METHOD_VERSION, "device": name, "onnxruntime": ort.__version__,
        "threads": threads, "method": method, "machine": platform.machine(),
        "cpus": os.cpu_count()})
    times = _measure_signatures(ctx, sigs, cache, method, progress)
    spec = DeviceSpec.cpu() if cuda_id is None else DeviceSpec.gpu_h100()
    costs = calibrate(graph, sigs, times, spec, ratios)
    settings: dict[str, object] = {
        "method": method, "repeats": repeats, "warmup": warmup, "threads": threads,
        "input_shapes": {k: list(v) for k, v in graph.input_shapes.items()},
        "whole_optimization": "ORT_ENABLE_ALL",
        "calibration": "(shortest event - event_overhead + node_overhead) scaled to the "
                       "unprofiled whole-model median",
        "event_overhead_ms": times.event_overhead_ms, "node_overhead_ms": times.node_overhead_ms,
        "weights_sum_ms": costs.weights_sum_ms, "scale": costs.scale,
        "analytic_nodes": costs.analytic_nodes, "whole_cached": times.whole_cached,
        "clock": "thread_time" if ctx.clock is time.thread_time else "perf_counter",
        "cache": str(cache.path) if cache.path else None, **ctx.settings.recorded()}
    return ProfileResult(costs.forward_ms, costs.backward_ms, times.whole_ms, costs.raw_sum_ms,
                         name, ort.__version__, settings, len(times.measured_nodes),
                         costs.reused, provenance(graph, name))


def _checked_ratios(repeats: int, warmup: int, threads: int, method: str,
                    backward_ratio: Mapping[str, float] | None) -> dict[str, float]:
    """The backward ratios, once the measuring arguments are checked."""
    if repeats < 1 or warmup < 0 or threads < 1:
        raise PartitionError(f"need repeats >= 1, warmup >= 0, threads >= 1; got {repeats}, "
                             f"{warmup}, {threads}")
    if method not in ("signatures", "whole"):
        raise PartitionError(f"unknown profiling method {method!r} (use signatures or whole)")
    ratios = dict(backward_ratio or {})
    if any(not r >= 0 for r in ratios.values()):
        raise PartitionError(f"backward ratios must be >= 0, got {ratios}")
    return ratios


def _measure_signatures(ctx: Context, sigs: Mapping[int, tuple[str, bool]], cache: Cache,
                        method: str, progress: Progress | None) -> SignatureTimes:
    """Raw times of every signature, the calibration terms and the whole-model time: from the
    cache where it has them (cacheable signatures only), else measured and cached."""
    groups = signature_groups(sigs)
    cacheable = {digest for digest, ok in sigs.values() if ok}
    raw_ms: dict[str, float] = {d: t for d in groups if d in cacheable
                                and (t := cache.get(d)) is not None}
    event_overhead = cache.get("event_overhead") or 0.0
    todo = [d for d in groups if d not in raw_ms]
    whole_key = "whole:" + model_digest(ctx.graph)
    whole_ms = cache.get(whole_key)

    per_phase = ctx.warmup + ctx.repeats
    steps = (per_phase * (2 * len(todo) if ctx.cuda_id is not None and method == "signatures"
                          else min(len(todo), 1))
             + (per_phase if whole_ms is None else 0))
    ticker = Ticker(progress, steps)
    measured: dict[str, float] = {}
    start = time.perf_counter()
    if todo:
        measured, event_overhead = measure(ctx, groups, todo, method, ticker)
        raw_ms.update(measured)
        cache.put({**{d: t for d, t in measured.items() if d in cacheable},
                   "event_overhead": event_overhead})
    tiny_node = cache.get("node_overhead")
    if tiny_node is None:
        tiny_node = node_overhead(ctx) if ctx.cuda_id is None else 0.0
        cache.put({"node_overhead": tiny_node})
    ctx.settings.measure_s = round(time.perf_counter() - start, 3)
    whole_cached = whole_ms is not None
    if whole_ms is None:
        start = time.perf_counter()
        whole_ms, ctx.settings.whole_runs = time_whole(ctx, ticker)
        ctx.settings.whole_s = round(time.perf_counter() - start, 3)
        cache.put({whole_key: whole_ms})
    ticker.finish()
    return SignatureTimes(raw_ms, {groups[d][0] for d in measured}, event_overhead, tiny_node,
                          whole_ms, whole_cached)


def save_profile(result: ProfileResult, path: Path) -> None:
    """Write ``result`` as costs.json (the contract in docs/design.md), atomically."""
    path = Path(path)
    if path.is_dir():
        raise PartitionError(f"output {path} is a folder; give a file name such as costs.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    costs = {k: {"forward_ms": round(v, 6), "backward_ms": round(result.backward_ms[k], 6)}
             for k, v in result.forward_ms.items()}
    write_costs(path, costs, device=result.device, source="profile",
                onnxruntime=result.onnxruntime, **result.provenance,
                whole_model_ms=round(result.whole_model_ms, 6),
                raw_sum_ms=round(result.raw_sum_ms, 6),
                unique_signatures=result.unique_signatures, reused=result.reused,
                settings=result.settings)


def profile_to_file(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    batch_size: int | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    repeats: int = 20,
    progress: Progress | None = None,
    threads: int = 1,
    cache_dir: Path | None = None,
) -> ProfileResult:
    """Load ``model_path``, profile it on ``device`` and write costs.json to ``out_path``."""
    parse_device(device)  # fail before loading
    out = Path(out_path)
    if out.is_dir():
        raise PartitionError(f"output {out} is a folder; give a file name such as costs.json")
    graph = load(model_path, input_shapes=input_shapes, batch_size=batch_size)
    result = profile_model(graph, device=device, repeats=repeats, threads=threads,
                           cache_dir=cache_dir, progress=progress)
    save_profile(result, out)
    return result


def parse_device(device: str) -> tuple[str, int | None]:
    """``cpu`` -> ("cpu", None); ``cuda`` / ``cuda:N`` -> ("cuda:N", N), if onnxruntime has CUDA."""
    index = device_index(device.strip() if isinstance(device, str) else device)
    if index is None:
        return "cpu", None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise PartitionError(
            f"device {device!r} needs onnxruntime-gpu (CUDAExecutionProvider is not available)"
        )
    return f"cuda:{index}", index
