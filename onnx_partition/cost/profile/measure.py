"""Raw signature times on the device (CPU events or CUDA timing), and the whole model's time.

``method="signatures"`` measures one signature model of the nodes still to measure;
``method="whole"`` profiles the whole model with optimizations off (fusions rename nodes) and
shares times between identical signatures (also the fallback when the signature model cannot
be built), on CPU only: on CUDA the profiler's events are launch times, so CUDA refuses
``whole`` and never falls back to it (:mod:`~onnx_partition.cost.profile.cuda`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from onnx_partition.cost.profile.cpu import profile_events
from onnx_partition.cost.profile.cuda import cuda_runner, time_cuda_nodes
from onnx_partition.cost.profile.harness import Context, Ticker, input_feeds, repeat, run_session
from onnx_partition.errors import PartitionError

__all__ = ["measure", "time_whole"]


def measure(ctx: Context, groups: Mapping[str, list[int]], todo: Sequence[str], method: str,
            ticker: Ticker) -> tuple[dict[str, float], float]:
    """Signature -> raw ms (``FOLDED`` for constant-folded nodes) for the signatures in
    ``todo``, and the profiler's own time per event (0 on CUDA)."""
    graph = ctx.graph
    if ctx.cuda_id is not None and method != "signatures":
        raise PartitionError(f"profiling method {method!r} reads the profiler's launch times on "
                             f"CUDA; use signatures")
    if method == "signatures":
        reps = [groups[d][0] for d in todo]
        try:
            if ctx.cuda_id is None:
                per_node, overhead = profile_events(ctx, reps, ticker)
            else:  # no fallback to profiler events on CUDA: errors propagate
                per_node, overhead = time_cuda_nodes(ctx, reps, ticker), 0.0
            keys = {graph.nodes[r].key: d for r, d in zip(reps, todo)}
            return {keys[k]: t for k, t in per_node.items() if k in keys}, overhead
        except PartitionError as exc:  # an odd node the signature model cannot hold
            if ctx.cuda_id is not None:
                raise
            ctx.settings.signature_model_error = str(exc)
            ctx.settings.method_used = "whole"
    per_node, overhead = profile_events(ctx, None, ticker)
    result = {}
    for digest in todo:
        times = [per_node[graph.nodes[i].key] for i in groups[digest]
                 if graph.nodes[i].key in per_node]
        if times:
            result[digest] = statistics.median(times)
    return result, overhead


def time_whole(ctx: Context, ticker: Ticker) -> tuple[float, int]:
    """Median unprofiled time (ms) of the whole model, with the runtime's session options."""
    feeds = input_feeds(ctx.graph)
    session = ctx.session(ctx.graph.model, ctx.options(optimize=True), "the model")
    if ctx.cuda_id is None:
        times = repeat(lambda: run_session(session, feeds, "the model"), ctx, ticker)
    else:
        times = repeat(cuda_runner(ctx, session, feeds), ctx, ticker)
    return statistics.median(times), len(times)
