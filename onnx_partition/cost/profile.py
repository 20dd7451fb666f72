"""Per-node costs measured with onnxruntime on the real device, written as costs.json.

Method:

1. **Signatures.** Nodes are grouped by signature: domain, op type, opset, attributes, input and
   output dtypes and concrete shapes, and which inputs are initializers (``init``), outputs of
   constant-only nodes (``const``) or computed values (``flow``); small initializers add their
   values. Only one node per signature is measured, so a transformer's repeated layers cost one
   layer's profiling. Signature times are cached on disk (``cache_dir``, default
   ``$ONNX_PARTITION_CACHE`` or ``~/.cache/onnx-partition/profiles``), keyed by signature, device,
   onnxruntime version, threads and method.
2. **Measurement.** The nodes still to measure go into one *signature model*: each node once, its
   real initializers (external data resolved from the model's folder), copies of the constant
   nodes it needs, and its computed inputs as graph inputs (random floats of the right shape;
   integer, boolean and unknown-shape values captured from one run of the whole model).
   On CPU the model is profiled (``enable_profiling``) with the runtime's optimizations, so that
   rewrites of single nodes that the real run also makes (NCHWc Conv, constant folding) count;
   nothing can fuse across nodes there, and events map back to keys by name or output name.
   Each node's shortest ``<key>_kernel_time`` over the repeats is taken (events are wall-clock;
   other processes only ever stretch them). On CUDA the
   profiler sees only host time around asynchronous launches, so each signature is timed by wall
   clock with IOBinding instead: ``(T(K copies) - T(1 copy)) / (K - 1)``, which cancels the fixed
   cost of a run (optimizations off, so that the copies are not merged). ``method="whole"``
   profiles the whole model with optimizations off (fusions rename nodes) and shares times
   between identical signatures (also the fallback when the signature model cannot be built).
3. **Calibration.** The profiler adds its own few microseconds to every event, which swamps tiny
   operators (a 4-element Add shows 5 us and really costs 0.5 us). So a node's weight is its
   event time minus the profiler's time per event (that of one-element Add probes profiled
   alongside), plus what a tiny node really costs unprofiled (the time difference of
   two Add chains of different lengths, per node). Nodes with no measurement get their analytic
   (roofline) cost as weight. The weights are then scaled to sum to the median *unprofiled*
   whole-model time, measured with the runtime's own session options (on one CPU thread as
   thread CPU time, which other processes on a shared machine do not inflate).

Each measuring phase repeats ``repeats`` times but stops early after ``_BUDGET_S`` seconds once
``_MIN_RUNS`` runs are in (large models); ``settings`` records the runs made.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from onnx_partition.cost.analytic import DeviceSpec, backward_factor
from onnx_partition.cost.analytic import forward_ms as analytic_forward_ms
from onnx_partition.cost.annotate import op_infos, write_costs
from onnx_partition.cost.costs_file import provenance
from onnx_partition.errors import PartitionError
from onnx_partition.graph import NONDETERMINISTIC, OpGraph, load, shape_of
from onnx_partition.runtime.stages import session_options

Progress = Callable[[int, int], None]

#: Environment variable overriding the default cache folder.
CACHE_ENV = "ONNX_PARTITION_CACHE"
#: Bump when measurements are no longer comparable with cached ones.
_METHOD_VERSION = 1
#: Soft time limit (seconds) of one measuring phase, once ``_MIN_RUNS`` timed runs are in.
_BUDGET_S = 10.0
_MIN_RUNS = 3
#: Copies of a node in the second CUDA timing model.
_CUDA_COPIES = 4
#: One-element Adds measuring the profiler's own time per event, and the extra ones measuring a
#: tiny node's real cost.
_PROBES = 8
_PROBES_EXTRA = 200
#: Raw time of a node that onnxruntime constant-folds (it then costs nothing).
_FOLDED = -1.0
#: Integer and boolean initializers with at most this many elements (axes, shapes, indices), and
#: scalars (exponents, bounds), take part in signatures by value; other values change no cost.
_VALUE_ELEMENTS = 64
_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
_RANDOM_FLOATS = (np.float16, np.float32, np.float64)
_EXACT_TYPES = frozenset({
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64, onnx.TensorProto.BOOL})
_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


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


# --------------------------------------------------------------------------- public API


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
    (default) or ``"whole"`` (see the module docstring).
    """
    name, cuda_id = parse_device(device)
    if repeats < 1 or warmup < 0 or threads < 1:
        raise PartitionError(f"need repeats >= 1, warmup >= 0, threads >= 1; got {repeats}, "
                             f"{warmup}, {threads}")
    if method not in ("signatures", "whole"):
        raise PartitionError(f"unknown profiling method {method!r} (use signatures or whole)")
    ratios = dict(backward_ratio or {})
    if any(not r >= 0 for r in ratios.values()):
        raise PartitionError(f"backward ratios must be >= 0, got {ratios}")

    ctx = _Context(graph, name, cuda_id, threads, warmup, repeats)
    sigs = _signatures(graph)
    groups: dict[str, list[int]] = {}
    for index, (digest, _) in sigs.items():
        groups.setdefault(digest, []).append(index)
    cacheable = {digest for digest, ok in sigs.values() if ok}
    cache = _Cache(_cache_folder(cache_dir), {
        "version": _METHOD_VERSION, "device": name, "onnxruntime": ort.__version__,
        "threads": threads, "method": method, "machine": platform.machine(),
        "cpus": os.cpu_count()})
    sig_ms: dict[str, float] = {d: t for d in groups if d in cacheable
                                and (t := cache.get(d)) is not None}
    event_overhead = cache.get("event_overhead") or 0.0
    todo = [d for d in groups if d not in sig_ms]
    whole_key = "whole:" + _model_digest(graph)
    whole_ms = cache.get(whole_key)

    per_phase = warmup + repeats
    steps = (per_phase * (2 * len(todo) if cuda_id is not None and method == "signatures"
                          else min(len(todo), 1))
             + (per_phase if whole_ms is None else 0))
    ticker = _Ticker(progress, steps)
    info: dict[str, object] = {}
    measured: dict[str, float] = {}
    start = time.perf_counter()
    if todo:
        measured, event_overhead = _measure(ctx, groups, todo, method, ticker, info)
        sig_ms.update(measured)
        cache.put({**{d: t for d, t in measured.items() if d in cacheable},
                   "event_overhead": event_overhead})
    node_overhead = cache.get("node_overhead")
    if node_overhead is None:
        node_overhead = _node_overhead(ctx) if cuda_id is None else 0.0
        cache.put({"node_overhead": node_overhead})
    info["measure_s"] = round(time.perf_counter() - start, 3)
    whole_cached = whole_ms is not None
    if whole_ms is None:
        start = time.perf_counter()
        whole_ms, runs = _time_whole(ctx, ticker)
        info["whole_runs"] = runs
        info["whole_s"] = round(time.perf_counter() - start, 3)
        cache.put({whole_key: whole_ms})
    ticker.finish()

    spec = DeviceSpec.cpu() if cuda_id is None else DeviceSpec.gpu_h100()
    infos = op_infos(graph)
    weight: dict[str, float] = {}
    raw_sum = 0.0
    analytic = reused = 0
    reps = {groups[d][0] for d in measured}
    for index, (digest, _) in sigs.items():
        key = graph.nodes[index].key
        if digest in sig_ms:
            event = sig_ms[digest]
            raw_sum += max(event, 0.0)
            weight[key] = (0.0 if event == _FOLDED
                           else max(event - event_overhead, 0.0) + node_overhead)
            reused += index not in reps
        else:
            weight[key] = analytic_forward_ms(infos[index], spec)
            raw_sum += weight[key]
            analytic += 1
    total = sum(weight.values())
    scale = whole_ms / total if total > 0 else 1.0
    forward = {k: v * scale for k, v in weight.items()}
    op_type = {n.key: n.op_type for n in graph.nodes}
    backward = {k: v * ratios.get(op_type[k], backward_factor(op_type[k]))
                for k, v in forward.items()}
    settings: dict[str, object] = {
        "method": method, "repeats": repeats, "warmup": warmup, "threads": threads,
        "input_shapes": {k: list(v) for k, v in graph.input_shapes.items()},
        "whole_optimization": "ORT_ENABLE_ALL",
        "calibration": "(shortest event - event_overhead + node_overhead) scaled to the "
                       "unprofiled whole-model median",
        "event_overhead_ms": event_overhead, "node_overhead_ms": node_overhead,
        "weights_sum_ms": total, "scale": scale, "analytic_nodes": analytic,
        "whole_cached": whole_cached,
        "clock": "thread_time" if ctx.clock is time.thread_time else "perf_counter",
        "cache": str(cache.path) if cache.path else None, **info}
    return ProfileResult(forward, backward, whole_ms, raw_sum, name, ort.__version__, settings,
                         len(measured), reused, provenance(graph, name))


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
    match = _DEVICE.fullmatch(device.strip()) if isinstance(device, str) else None
    if match is None:
        raise PartitionError(f"unknown device {device!r} (use cpu or cuda:N)")
    if device.strip() == "cpu":
        return "cpu", None
    index = int(match.group(1) or 0)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise PartitionError(
            f"device {device!r} needs onnxruntime-gpu (CUDAExecutionProvider is not available)"
        )
    return f"cuda:{index}", index


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
        feeds[name] = _random(rng, dtype, graph.input_shapes[name], bounds.get(name, 2))
    return feeds


# --------------------------------------------------------------------------- signatures


def _signatures(graph: OpGraph) -> dict[int, tuple[str, bool]]:
    """Node index -> (signature digest, cacheable) for every compute node.

    A node with an unknown input or output shape gets a signature of its own (its key) that is
    never cached: it cannot be shown identical to anything else.
    """
    protos = graph.protos()
    inits = {t.name: t for t in graph.model.graph.initializer}
    free_out = {o for n in graph.nodes if n.free for o in n.outputs if o}
    opsets = {(o.domain or "ai.onnx"): o.version for o in graph.model.opset_import}
    out: dict[int, tuple[str, bool]] = {}
    for node in graph.nodes:
        if node.free:
            continue
        proto = protos[node.key]
        domain = proto.domain or "ai.onnx"
        captured = [n for n in (*node.inputs, *node.initializers) if n not in proto.input]
        ins = [_describe(graph, n, inits, free_out) for n in (*proto.input, *captured)]
        outs = [_describe(graph, n, inits, free_out) for n in proto.output]
        known = all(k for _, k in ins + outs)
        body = {
            "op": [domain, proto.op_type, opsets.get(domain)],
            "attrs": sorted((a.name, hashlib.sha256(a.SerializeToString()).hexdigest())
                            for a in proto.attribute),
            "in": [d for d, _ in ins[: len(proto.input)]],
            "captured": [d for d, _ in ins[len(proto.input):]],
            "out": [d for d, _ in outs],
            "node": None if known else node.key,
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        out[node.index] = (hashlib.sha256(text.encode()).hexdigest(), known)
    return out


def _describe(graph: OpGraph, name: str, inits: Mapping[str, onnx.TensorProto],
              free_out: set[str]) -> tuple[object, bool]:
    """A tensor's part of a signature: kind, dtype, shape (and value, for small initializers),
    and whether its type is fully known."""
    if not name:
        return None, True
    if name in inits:
        t = inits[name]
        entry: list[object] = ["init", t.data_type, list(t.dims)]
        numel = int(np.prod(t.dims))
        exact = t.data_type in _EXACT_TYPES and numel <= _VALUE_ELEMENTS
        if t.data_location != onnx.TensorProto.EXTERNAL and (numel <= 1 or exact):
            entry.append(numpy_helper.to_array(t).tobytes().hex())
        return entry, True
    ttype = graph.concrete_types.get(name)
    shape = shape_of(graph.concrete_types, name)
    elem = ttype.tensor_type.elem_type if ttype and ttype.HasField("tensor_type") else 0
    kind = "const" if name in free_out else "flow"
    return [kind, elem, list(shape) if shape is not None else None], bool(shape is not None
                                                                          and elem)


def _model_digest(graph: OpGraph) -> str:
    digest = hashlib.sha256(graph.model.SerializeToString(deterministic=True))
    digest.update(json.dumps(sorted(graph.input_shapes.items())).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- measuring


@dataclass
class _Context:
    """What every measuring step needs."""

    graph: OpGraph
    device: str
    cuda_id: int | None
    threads: int
    warmup: int
    repeats: int

    @property
    def clock(self) -> Callable[[], float]:
        """Thread CPU time on one CPU thread, else the wall clock (see :func:`_repeat`)."""
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
            return ort.InferenceSession(model.SerializeToString(), opts,
                                        providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = (str(exc).strip().splitlines() or ["?"])[0]
            raise PartitionError(f"onnxruntime cannot load {what} on {self.device}: "
                                 f"{first}") from None


class _Ticker:
    """Progress in runs done out of an upper bound; the bound is reached at the end."""

    def __init__(self, callback: Progress | None, total: int) -> None:
        self.callback, self.total, self.done = callback, max(total, 1), 0

    def tick(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def finish(self) -> None:
        self.tick(self.total - self.done)


def _repeat(run: Callable[[], object], ctx: _Context, ticker: _Ticker) -> list[float]:
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


def _measure(ctx: _Context, groups: Mapping[str, list[int]], todo: Sequence[str], method: str,
             ticker: _Ticker, info: dict[str, object]) -> tuple[dict[str, float], float]:
    """Signature -> raw ms (``_FOLDED`` for constant-folded nodes) for the signatures in
    ``todo``, and the profiler's own time per event (0 on CUDA)."""
    graph = ctx.graph
    if method == "signatures":
        reps = [groups[d][0] for d in todo]
        try:
            if ctx.cuda_id is None:
                per_node, overhead = _profile_events(ctx, reps, ticker, info)
            else:
                per_node, overhead = _time_cuda_nodes(ctx, reps, ticker, info), 0.0
            keys = {graph.nodes[r].key: d for r, d in zip(reps, todo)}
            return {keys[k]: t for k, t in per_node.items() if k in keys}, overhead
        except PartitionError as exc:  # an odd node the signature model cannot hold
            info["signature_model_error"] = str(exc)
            info["method_used"] = "whole"
    per_node, overhead = _profile_events(ctx, None, ticker, info)
    result = {}
    for digest in todo:
        times = [per_node[graph.nodes[i].key] for i in groups[digest]
                 if graph.nodes[i].key in per_node]
        if times:
            result[digest] = statistics.median(times)
    return result, overhead


def _profile_events(ctx: _Context, reps: list[int] | None, ticker: _Ticker,
                    info: dict[str, object]) -> tuple[dict[str, float], float]:
    """Node key -> kernel time (ms) from onnxruntime's profiler over the timed runs (see
    :func:`_kernel_times`), and the profiler's own time per event: that of ``_PROBES``
    one-element Adds added to the model (a few microseconds, which would otherwise swamp tiny
    operators).

    ``reps`` None profiles the whole model with optimizations off (fusions would rename nodes).
    Otherwise it profiles a signature model of those nodes with the runtime's optimizations:
    nothing can fuse across nodes there, and layout rewrites (NCHWc Conv on CPU, often 2x
    faster) keep a name made of the node's output; a node that leaves no event but reads only
    constants was constant-folded, as it is in the real model, and costs 0 (``_FOLDED``).
    """
    graph = ctx.graph
    names = {n.key: n.key for n in graph.nodes if not n.free}
    if reps is None:
        model, feeds, what = graph.model, input_feeds(graph), "the model"
        names.update({o: n.key for n in graph.nodes if not n.free for o in n.outputs if o})
    else:
        model, feeds = _signature_model(ctx, reps, 1, _flow_values(ctx, reps, info))
        what = "the signature model"
        names.update({f"{o}#p0": graph.nodes[r].key for r in reps
                      for o in graph.nodes[r].outputs if o})
    model, feeds = _with_probes(model, feeds)
    probes = [f"#probe{k}" for k in range(_PROBES)]
    names.update({p: p for p in probes})
    with tempfile.TemporaryDirectory(prefix="onnx-partition-profile-") as tmp:
        opts = ctx.options(optimize=reps is not None, profile_dir=tmp)
        info["profile_optimization"] = "ORT_ENABLE_ALL" if reps is not None else "ORT_DISABLE_ALL"
        session = ctx.session(model, opts, what)
        runs = _repeat(lambda: _run(session, feeds, what), ctx, ticker)
        trace = session.end_profiling()
        events = json.loads(Path(trace).read_text())
    info["profiled_runs"] = len(runs)
    info["profiled_run_ms"] = statistics.median(runs)
    medians, unmatched = _kernel_times(events, names, len(runs))
    info["unmatched_events"] = unmatched
    probed = [medians.pop(p) for p in probes if p in medians]
    overhead = statistics.median(probed) if probed else 0.0
    if reps is not None:
        constant = {o for n in graph.nodes if n.free for o in n.outputs if o}
        folded = [graph.nodes[r].key for r in reps if graph.nodes[r].key not in medians
                  and graph.nodes[r].op_type not in NONDETERMINISTIC
                  and all(i in constant for i in graph.nodes[r].inputs)]
        medians.update(dict.fromkeys(folded, _FOLDED))
        info["folded_signatures"] = len(folded)
    return medians, overhead


def _probe_chain(model: onnx.ModelProto, count: int) -> None:
    """Append ``count`` chained one-element Adds (``#probe<k>``) reading input ``#probe_in``."""
    model.graph.input.append(helper.make_tensor_value_info("#probe_in", onnx.TensorProto.FLOAT,
                                                           [1]))
    prev = "#probe_in"
    for k in range(count):
        model.graph.node.append(helper.make_node("Add", [prev, "#probe_in"], [f"#probe{k}:out"],
                                                 name=f"#probe{k}"))
        prev = f"#probe{k}:out"


def _with_probes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]
                 ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    _probe_chain(probed, _PROBES)
    return probed, {**feeds, "#probe_in": np.ones(1, np.float32)}


def _node_overhead(ctx: _Context) -> float:
    """What one tiny operator really costs unprofiled (executor dispatch included), in ms: the
    time difference of two chains of one-element Adds, per extra node."""
    medians = []
    feeds = {"#probe_in": np.ones(1, np.float32)}
    for count in (_PROBES, _PROBES + _PROBES_EXTRA):
        graph = helper.make_graph([], "probe", [], [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        _probe_chain(model, count)
        model.graph.output.append(onnx.ValueInfoProto(name=f"#probe{count - 1}:out"))
        session = ctx.session(model, ctx.options(optimize=True), "a probe model")
        for _ in range(5):
            _run(session, feeds, "a probe model")
        times = []
        for _ in range(50):
            t0 = ctx.clock()
            _run(session, feeds, "a probe model")
            times.append((ctx.clock() - t0) * 1e3)
        medians.append(statistics.median(times))
    return max(medians[1] - medians[0], 0.0) / _PROBES_EXTRA


def _kernel_times(events: Sequence[Mapping[str, Any]], names: Mapping[str, str],
                    runs: int) -> tuple[dict[str, float], int]:
    """Shortest ``<name>_kernel_time`` per node key over each name's last ``runs`` events (warm-up
    left out). Events are wall-clock: on a shared machine other processes stretch some of them,
    never shorten one, so the minimum of repeated identical runs is the robust estimate (as for
    ``timeit``; under load the median skewed stage predictions by up to 50%, the minimum by 7%).
    ``names`` maps node keys and other known names (outputs) to keys; see :func:`_match_key`.
    Also returns the number of event names matching no key."""
    durations: dict[str, list[float]] = {}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            durations.setdefault(name[: -len("_kernel_time")], []).append(
                float(event.get("dur", 0)) / 1e3)
    medians: dict[str, float] = {}
    unmatched = 0
    for name, durs in durations.items():
        key = _match_key(name, names)
        if key is None:
            unmatched += 1
            continue
        medians[key] = medians.get(key, 0.0) + min(durs[-runs:])
    return medians, unmatched


def _match_key(name: str, names: Mapping[str, str]) -> str | None:
    """The key an event name belongs to: the name itself, else the longest prefix ending before
    a ``_`` or ``/`` that is a known name (``<key>/MatMulScaleFusion/``, ``<output>_nchwc``)."""
    while name:
        if name in names:
            return names[name]
        cut = max(name.rfind("_"), name.rfind("/"))
        if cut <= 0:
            return None
        name = name[:cut]
    return None


def _time_cuda_nodes(ctx: _Context, reps: list[int], ticker: _Ticker,
                     info: dict[str, object]) -> dict[str, float]:
    """Node key -> ms on CUDA: (T(K copies) - T(1 copy)) / (K - 1), wall clock, IOBinding."""
    result: dict[str, float] = {}
    values = _flow_values(ctx, reps, info)
    for rep in reps:
        times = []
        for copies in (1, _CUDA_COPIES):
            model, feeds = _signature_model(ctx, [rep], copies, values)
            session = ctx.session(model, ctx.options(optimize=False), "a signature model")
            times.append(statistics.median(_repeat(_cuda_runner(ctx, session, feeds), ctx,
                                                   ticker)))
        result[ctx.graph.nodes[rep].key] = max(times[1] - times[0], 0.0) / (_CUDA_COPIES - 1)
    info["cuda_copies"] = _CUDA_COPIES
    info["profile_optimization"] = "ORT_DISABLE_ALL"
    return result


def _cuda_runner(ctx: _Context, session: ort.InferenceSession,
                 feeds: Mapping[str, np.ndarray]) -> Callable[[], None]:
    """A run with inputs already on the GPU and outputs left there, synchronized at the end."""
    assert ctx.cuda_id is not None
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(
            name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", ctx.cuda_id))
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda", ctx.cuda_id)

    def run() -> None:
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    return run


def _time_whole(ctx: _Context, ticker: _Ticker) -> tuple[float, int]:
    """Median unprofiled time (ms) of the whole model, with the runtime's session options."""
    feeds = input_feeds(ctx.graph)
    session = ctx.session(ctx.graph.model, ctx.options(optimize=True), "the model")
    if ctx.cuda_id is None:
        times = _repeat(lambda: _run(session, feeds, "the model"), ctx, ticker)
    else:
        times = _repeat(_cuda_runner(ctx, session, feeds), ctx, ticker)
    return statistics.median(times), len(times)


def _run(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray], what: str) -> None:
    try:
        session.run(None, dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        first = (str(exc).strip().splitlines() or ["?"])[0]
        raise PartitionError(f"onnxruntime failed to run {what}: {first}") from None


# --------------------------------------------------------------------------- signature model


def _signature_model(ctx: _Context, reps: Sequence[int], copies: int,
                     values: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto,
                                                                 dict[str, np.ndarray]]:
    """A model running each node of ``reps`` ``copies`` times, and its feeds.

    Inputs keep their names: initializers are the real ones, constant-only nodes are copied in,
    computed values become graph inputs. Outputs are renamed (``<name>#p<copy>``) so that no
    node's output collides with another's input, and are not graph outputs (a graph output
    would be copied where in the model it is a view, as for Reshape); onnxruntime still runs
    nodes whose outputs nobody reads when optimizations are off. The one graph output is a
    constant.
    """
    graph = ctx.graph
    src = graph.model
    protos = graph.protos()
    inits = {t.name: t for t in src.graph.initializer}
    free = {o for n in graph.nodes if n.free for o in n.outputs if o}
    needed = [name for r in reps for name in graph.nodes[r].inputs]
    closure = graph.free_closure(needed)
    flow = list(dict.fromkeys(n for n in needed if n not in free and n not in inits))
    used_inits = dict.fromkeys(
        name for i in (*closure, *reps) for name in graph.nodes[i].initializers)

    nodes: list[onnx.NodeProto] = [protos[graph.nodes[i].key] for i in closure]
    done = "#profile_done"
    nodes.append(helper.make_node("Constant", [], [done], name=done,
                                  value=helper.make_tensor(done, onnx.TensorProto.FLOAT, [], [0])))
    for r in reps:
        for c in range(copies):
            node = onnx.NodeProto()
            node.CopyFrom(protos[graph.nodes[r].key])
            if c:
                node.name = f"{node.name}#copy{c}"
            for k, out in enumerate(node.output):
                if out:
                    node.output[k] = f"{out}#p{c}"
            nodes.append(node)
    feeds = {name: values[name] for name in flow}
    inputs = [helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value in feeds.items()]
    outputs = [helper.make_tensor_value_info(done, onnx.TensorProto.FLOAT, [])]
    body = helper.make_graph(nodes, "onnx-partition-profile", inputs, outputs,
                             initializer=[inits[n] for n in used_inits])
    model = helper.make_model(body, opset_imports=list(src.opset_import),
                              ir_version=max(src.ir_version, 4))
    model.functions.extend(src.functions)
    return model, feeds


def _flow_values(ctx: _Context, reps: Sequence[int],
                 info: dict[str, object]) -> dict[str, np.ndarray]:
    """Values for the computed tensors ``reps`` read: graph inputs' random feeds, random floats
    of the concrete shape, and values captured from one run of the whole model for the rest
    (integers, booleans, unknown shapes)."""
    graph = ctx.graph
    free = {o for n in graph.nodes if n.free for o in n.outputs if o}
    names = [n for r in reps for n in graph.nodes[r].inputs if n not in free]
    names = list(dict.fromkeys(n for n in names if n not in graph.initializer_bytes))
    rng = np.random.default_rng(1)
    feeds = input_feeds(graph)
    values: dict[str, np.ndarray] = {}
    capture = []
    for name in names:
        if name in feeds:
            values[name] = feeds[name]
            continue
        ttype = graph.concrete_types.get(name)
        shape = shape_of(graph.concrete_types, name)
        elem = ttype.tensor_type.elem_type if ttype and ttype.HasField("tensor_type") else 0
        dtype = helper.tensor_dtype_to_np_dtype(elem) if elem else None
        if shape is not None and dtype is not None and dtype in _RANDOM_FLOATS:
            values[name] = _random(rng, dtype, shape, 2)
        else:
            capture.append(name)
    if capture:
        values.update(_capture(ctx, capture, feeds))
    info["captured_values"] = len(capture)
    return values


def _capture(ctx: _Context, names: Sequence[str],
             feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Values of intermediate tensors, from one CPU run of the model with them as outputs."""
    model = onnx.ModelProto()
    model.CopyFrom(ctx.graph.model)
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in present)
    cpu = _Context(ctx.graph, "cpu", None, ctx.threads, 0, 1)
    session = cpu.session(model, cpu.options(optimize=False), "the model (capturing inputs)")
    try:
        values = session.run(list(names), dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        first = (str(exc).strip().splitlines() or ["?"])[0]
        raise PartitionError(f"onnxruntime failed to run the model: {first}") from None
    result = {}
    for name, value in zip(names, values):
        if not isinstance(value, np.ndarray):
            raise PartitionError(f"value {name!r} is not a tensor; cannot profile its readers")
        result[name] = value
    return result


def _random(rng: np.random.Generator, dtype: Any, shape: Sequence[int],
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


# --------------------------------------------------------------------------- cache


def _cache_folder(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "onnx-partition" / "profiles"


class _Cache:
    """Signature -> ms for one context (device, onnxruntime, threads, ...), one JSON file.

    Best effort: an unreadable or unwritable cache is ignored; writes merge and replace
    atomically, so concurrent profilers at worst lose each other's new entries.
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
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"context": self.context, "values": merged}))
            os.replace(tmp, self.path)
        except OSError:
            pass
