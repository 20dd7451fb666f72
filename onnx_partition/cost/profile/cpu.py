"""CPU timing from onnxruntime's profiler events, and the profiler's own cost per event.

On CPU the model is profiled (``enable_profiling``) with the runtime's optimizations, so that
rewrites of single nodes that the real run also makes (NCHWc Conv, constant folding) count;
nothing can fuse across nodes in a signature model, and events map back to keys by name or
output name. Each node's shortest ``<key>_kernel_time`` over the repeats is taken (events are
wall-clock; other processes only ever stretch them).

The profiler adds its own few microseconds to every event, which swamps tiny operators (a
4-element Add shows 5 us and really costs 0.5 us): one-element Add probes profiled alongside
measure that time per event, and two unprofiled Add chains of different lengths measure what a
tiny node really costs (:func:`node_overhead`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnx_partition.cost.profile.harness import Context, Ticker, input_feeds, repeat, run_session
from onnx_partition.cost.profile.sigmodel import flow_values, signature_model
from onnx_partition.graph import NONDETERMINISTIC

__all__ = ["FOLDED", "node_overhead", "profile_events"]

#: One-element Adds measuring the profiler's own time per event, and the extra ones measuring a
#: tiny node's real cost.
_PROBES = 8
_PROBES_EXTRA = 200
#: Raw time of a node that onnxruntime constant-folds (it then costs nothing).
FOLDED = -1.0


def profile_events(ctx: Context, reps: list[int] | None,
                   ticker: Ticker) -> tuple[dict[str, float], float]:
    """Node key -> kernel time (ms) from onnxruntime's profiler over the timed runs (see
    :func:`_kernel_times`), and the profiler's own time per event: that of ``_PROBES``
    one-element Adds added to the model (a few microseconds, which would otherwise swamp tiny
    operators).

    ``reps`` None profiles the whole model with optimizations off (fusions would rename nodes).
    Otherwise it profiles a signature model of those nodes with the runtime's optimizations:
    nothing can fuse across nodes there, and layout rewrites (NCHWc Conv on CPU, often 2x
    faster) keep a name made of the node's output; a node that leaves no event but reads only
    constants was constant-folded, as it is in the real model, and costs 0 (``FOLDED``).
    """
    graph = ctx.graph
    names = {n.key: n.key for n in graph.nodes if not n.free}
    if reps is None:
        model, feeds, what = graph.model, input_feeds(graph), "the model"
        names.update({o: n.key for n in graph.nodes if not n.free for o in n.outputs if o})
    else:
        model, feeds = signature_model(ctx, reps, 1, flow_values(ctx, reps))
        what = "the signature model"
        names.update({f"{o}#p0": graph.nodes[r].key for r in reps
                      for o in graph.nodes[r].outputs if o})
    model, feeds = _with_probes(model, feeds)
    probes = [f"#probe{k}" for k in range(_PROBES)]
    names.update({p: p for p in probes})
    settings = ctx.settings
    with tempfile.TemporaryDirectory(prefix="onnx-partition-profile-") as tmp:
        opts = ctx.options(optimize=reps is not None, profile_dir=tmp)
        settings.profile_optimization = ("ORT_ENABLE_ALL" if reps is not None
                                         else "ORT_DISABLE_ALL")
        session = ctx.session(model, opts, what)
        runs = repeat(lambda: run_session(session, feeds, what), ctx, ticker)
        trace = session.end_profiling()
        events = json.loads(Path(trace).read_text())
    settings.profiled_runs = len(runs)
    settings.profiled_run_ms = statistics.median(runs)
    kernel_ms, settings.unmatched_events = _kernel_times(events, names, len(runs))
    probed = [kernel_ms.pop(p) for p in probes if p in kernel_ms]
    overhead = statistics.median(probed) if probed else 0.0
    if reps is not None:
        folded = [graph.nodes[r].key for r in reps if graph.nodes[r].key not in kernel_ms
                  and graph.nodes[r].op_type not in NONDETERMINISTIC
                  and all(i in graph.free_outputs for i in graph.nodes[r].inputs)]
        kernel_ms.update(dict.fromkeys(folded, FOLDED))
        settings.folded_signatures = len(folded)
    return kernel_ms, overhead


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


def node_overhead(ctx: Context) -> float:
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
            run_session(session, feeds, "a probe model")
        times = []
        for _ in range(50):
            t0 = ctx.clock()
            run_session(session, feeds, "a probe model")
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
    shortest: dict[str, float] = {}
    unmatched = 0
    for name, durs in durations.items():
        key = _match_key(name, names)
        if key is None:
            unmatched += 1
            continue
        shortest[key] = shortest.get(key, 0.0) + min(durs[-runs:])
    return shortest, unmatched


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
