"""CUDA timing with IOBinding and CUDA events.

On CUDA the profiler sees only host time around asynchronous launches, so each signature is
timed instead: ``(T(K copies) - T(1 copy)) / (K - 1)``, which cancels the fixed cost of a run
(optimizations off, so that the copies are not merged). How, and why:

* **Inputs from HBM, not L2.** Each copy reads its own copy of the computed inputs
  (:func:`own_inputs`), so copy 2 does not find copy 1's inputs in L2; and the runs rotate over
  :func:`rotation_sets` sets of input buffers whose bytes exceed twice the L2 cache, so a run
  does not find the previous run's either (memory-bound nodes would come out too fast).
  Weights (initializers) stay shared.
* **CUDA events** recorded on torch's current stream, which onnxruntime runs on
  (``user_compute_stream``): the device time of each run, read after it.
* **No profiler-launch-time fallback**: a signature whose model cannot be built or run is left
  out (its node keeps the analytic cost), named in ``settings.signature_model_error``, and
  ``method="whole"`` (profiler events) is refused on CUDA.
* **Two sessions per signature** (1 and K copies). One session per batch of signatures, each
  signature's runs selected by its outputs, needs onnxruntime to run only the nodes a fetch
  needs; ``RunOptions.only_execute_path_to_fetches`` is ignored by the onnxruntime this was
  written against (every node ran on CPU), so the batch would time every signature at once.

The CPU path (:mod:`~onnx_partition.cost.profile.cpu`) is untouched; the helpers here that need
no GPU (rotation sizing, each copy's own inputs) are tested on CPU.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnx_partition.cost.profile.harness import Context, Ticker
from onnx_partition.cost.profile.sigmodel import flow_values, signature_model
from onnx_partition.errors import PartitionError, one_line
from onnx_partition.graph.ort import Provider, open_session

__all__ = ["cuda_runner", "own_inputs", "rotation_sets", "time_cuda_nodes"]

#: Copies of a node in the K-copy timing.
_CUDA_COPIES = 4
#: Rotated input sets: at most this many, within this share of the free device memory.
_MOST_SETS = 64
_MEMORY_SHARE = 0.25
#: L2 size when the device does not report one (the H100's 50 MB, rounded up).
_DEFAULT_L2 = 64 << 20


def rotation_sets(read_bytes: int, l2_bytes: int, budget_bytes: int, set_bytes: int = 0,
                  most: int = _MOST_SETS) -> int:
    """How many input sets to rotate so that a run reads inputs the L2 cache no longer holds:
    between two reads of a set, the other sets' ``(R - 1) x read_bytes`` (the bytes one run
    reads) exceed twice ``l2_bytes``; at least 1, at most ``most``, and no more sets of
    ``set_bytes`` (default ``read_bytes``) than ``budget_bytes`` holds."""
    if read_bytes <= 0:
        return 1
    wanted = math.ceil(2 * l2_bytes / read_bytes) + 1
    return max(1, min(wanted, most, budget_bytes // max(set_bytes or read_bytes, 1)))


def own_inputs(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], keys: Sequence[str]
               ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The signature model of ``keys`` (from
    :func:`~onnx_partition.cost.profile.sigmodel.signature_model`) with copy ``c >= 1`` of each
    node reading ``name#in<c>``, its own copy of each computed input, and the feeds for them."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    flow = {i.name: i for i in out.graph.input}
    new_feeds = dict(feeds)
    wanted = set(keys)
    added: list[onnx.ValueInfoProto] = []
    for node in out.graph.node:
        key, _, copy = node.name.partition("#copy")
        if key not in wanted or not copy:
            continue
        for k, name in enumerate(node.input):
            if name in flow:
                renamed = f"{name}#in{copy}"
                if renamed not in new_feeds:
                    new_feeds[renamed] = np.array(feeds[name], copy=True)
                    info = onnx.ValueInfoProto()
                    info.CopyFrom(flow[name])
                    info.name = renamed
                    added.append(info)
                node.input[k] = renamed
    out.graph.input.extend(added)
    return out, new_feeds


class _Unmeasurable(PartitionError):
    """A signature this device cannot time (its model cannot be built, loaded or run); a
    provider that is not the one asked for is a plain PartitionError and ends the profile."""


def time_cuda_nodes(ctx: Context, reps: list[int], ticker: Ticker) -> dict[str, float]:
    """Node key -> ms on CUDA: (T(K copies) - T(1 copy)) / (K - 1), CUDA events, IOBinding,
    each copy on its own inputs, rotated input sets (see the module's notes)."""
    import torch

    assert ctx.cuda_id is not None
    values = flow_values(ctx, reps)
    result: dict[str, float] = {}
    failed: list[str] = []
    with torch.cuda.device(ctx.cuda_id):
        properties = torch.cuda.get_device_properties(ctx.cuda_id)
        l2 = int(getattr(properties, "L2_cache_size", 0) or _DEFAULT_L2)
        free, _ = torch.cuda.mem_get_info(ctx.cuda_id)
        budget = int(free * _MEMORY_SHARE)
        for rep in reps:
            key = ctx.graph.nodes[rep].key
            try:
                times = [_time_copies(ctx, rep, copies, values, l2, budget, ticker)
                         for copies in (1, _CUDA_COPIES)]
            except _Unmeasurable as exc:
                failed.append(f"{key}: {exc}")
                continue
            result[key] = max(times[1] - times[0], 0.0) / (_CUDA_COPIES - 1)
    if failed:
        ctx.settings.signature_model_error = (f"{len(failed)} signature(s) not measured, "
                                              f"first {failed[0]}")
    ctx.settings.cuda_copies = _CUDA_COPIES
    ctx.settings.profile_optimization = "ORT_DISABLE_ALL"
    return result


def _time_copies(ctx: Context, rep: int, copies: int, values: Mapping[str, np.ndarray],
                 l2: int, budget: int, ticker: Ticker) -> float:
    """Median device ms of a model running ``copies`` copies of node ``rep``."""
    import torch

    assert ctx.cuda_id is not None
    key = ctx.graph.nodes[rep].key
    try:
        model, feeds = own_inputs(*signature_model(ctx, [rep], copies, values), [key])
    except PartitionError as exc:
        raise _Unmeasurable(str(exc)) from None
    stream = torch.cuda.current_stream()
    options: dict[str, Any] = {"device_id": ctx.cuda_id,
                               "user_compute_stream": str(stream.cuda_stream)}
    providers: list[Provider] = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    try:
        session = open_session(model.SerializeToString(), ctx.options(optimize=False),
                               providers, f"a signature model on {ctx.device}")
    except PartitionError:  # the provider it got is not the one asked for
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        raise _Unmeasurable(f"onnxruntime cannot load it: {one_line(exc)}") from None
    set_bytes = sum(a.nbytes for a in feeds.values())
    count = rotation_sets(set_bytes, l2, budget)
    sets = [{n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", ctx.cuda_id)
             for n, a in feeds.items()} for _ in range(count)]
    run = _event_runner(ctx.cuda_id, session, sets, stream)
    return statistics.median(_repeat_ms(run, ctx, ticker))


def _event_runner(cuda_id: int, session: ort.InferenceSession,
                  sets: Sequence[Mapping[str, ort.OrtValue]], stream: Any) -> Callable[[], float]:
    """A run on the next input set, outputs left on the device, timed with CUDA events on
    ``stream`` (ms)."""
    import torch

    bindings = []
    for inputs in sets:
        binding = session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        for out in session.get_outputs():
            binding.bind_output(out.name, "cuda", cuda_id)
        bindings.append(binding)
    turn = _cycle(len(bindings))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run() -> float:
        binding = bindings[next(turn)]
        start.record(stream)
        try:
            session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise _Unmeasurable(f"onnxruntime failed: {one_line(exc)}") from None
        end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end))

    return run


def _cycle(n: int) -> Iterator[int]:
    while True:
        yield from range(n)


def _repeat_ms(run: Callable[[], float], ctx: Context, ticker: Ticker) -> list[float]:
    """Warm up, then ``ctx.repeats`` device times (ms) of ``run``."""
    for _ in range(ctx.warmup):
        run()
        ticker.tick()
    times = []
    for _ in range(max(ctx.repeats, 1)):
        times.append(run())
        ticker.tick()
    return times


def cuda_runner(ctx: Context, session: ort.InferenceSession,
                feeds: Mapping[str, np.ndarray]) -> Callable[[], None]:
    """A run with inputs already on the GPU and outputs left there, synchronized at the end
    (the whole model's time, by wall clock as the runtime sees it)."""
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
