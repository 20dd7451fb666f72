"""CUDA timing by wall clock with IOBinding.

On CUDA the profiler sees only host time around asynchronous launches, so each signature is
timed instead: ``(T(K copies) - T(1 copy)) / (K - 1)``, which cancels the fixed cost of a run
(optimizations off, so that the copies are not merged).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

import numpy as np
import onnxruntime as ort

from onnx_partition.cost.profile.harness import Context, Ticker, repeat
from onnx_partition.cost.profile.sigmodel import flow_values, signature_model

__all__ = ["cuda_runner", "time_cuda_nodes"]

#: Copies of a node in the second CUDA timing model.
_CUDA_COPIES = 4


def time_cuda_nodes(ctx: Context, reps: list[int], ticker: Ticker) -> dict[str, float]:
    """Node key -> ms on CUDA: (T(K copies) - T(1 copy)) / (K - 1), wall clock, IOBinding."""
    result: dict[str, float] = {}
    values = flow_values(ctx, reps)
    for rep in reps:
        times = []
        for copies in (1, _CUDA_COPIES):
            model, feeds = signature_model(ctx, [rep], copies, values)
            session = ctx.session(model, ctx.options(optimize=False), "a signature model")
            times.append(statistics.median(repeat(cuda_runner(ctx, session, feeds), ctx,
                                                  ticker)))
        result[ctx.graph.nodes[rep].key] = max(times[1] - times[0], 0.0) / (_CUDA_COPIES - 1)
    ctx.settings.cuda_copies = _CUDA_COPIES
    ctx.settings.profile_optimization = "ORT_DISABLE_ALL"
    return result


def cuda_runner(ctx: Context, session: ort.InferenceSession,
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
