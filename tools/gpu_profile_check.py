"""Check profiled costs on a CUDA device: per-node sum vs end-to-end time, and stage times.

    python tools/gpu_profile_check.py [--device cuda:0] [--recipes gpt resnet] [--size small]
                                      [--batch-size 8] [--stages 2] [--repeats 20]

``--device cpu`` runs the same check on one CPU thread (times are thread CPU times there).

For each recipe: export it, profile it on the device (each new operator signature timed with
CUDA events as (T(4 copies) - T(1 copy)) / 3 with IOBinding, each copy on its own inputs and
input sets rotated past the L2 cache: onnx_partition/cost/profile/cuda.py), and compare the raw
per-node sum with the unprofiled whole-model time. Then partition it into ``--stages`` stages
with those costs, nodes left unmeasured priced by the device model of the GPU here, and time
every stage file alone on the device against its predicted time (the sum of its nodes'
calibrated costs). Prints two Markdown tables (docs/benchmarks.md takes them as is) and one
JSON line of all figures. Exits 0 with a message, measuring nothing, when onnxruntime has no
CUDA provider or no CUDA device answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from _gpu import here_gpu, table
from onnx import TensorProto, helper

from onnx_partition.cost.devices import gpu, measured_cpu
from onnx_partition.cost.profile import input_feeds, parse_device, profile_model, save_profile
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.graph.ort import open_session, session_options
from onnx_partition.partition import partition


def cuda_unavailable(device: str) -> str | None:
    """Why ``device`` cannot be used, or None when a tiny model runs on it."""
    try:
        _, index = parse_device(device)
    except PartitionError as exc:
        return str(exc)
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=[
            ("CUDAExecutionProvider", {"device_id": index})])
        session.run(None, {"x": np.ones(4, np.float32)})
    except Exception as exc:  # onnxruntime raises its own exception types
        return f"no CUDA device answers as {device}: {str(exc).strip().splitlines()[0]}"
    if "CUDAExecutionProvider" not in session.get_providers():
        return f"onnxruntime fell back to {session.get_providers()} for {device}"
    return None


def stage_runner(path: Path, feeds: dict[str, np.ndarray],
                 index: int | None) -> Callable[[], float]:
    """A function running ``path`` once and returning its time in ms: on the GPU with inputs
    already there and outputs left there, or (``index`` None) on one CPU thread, in thread CPU
    time."""
    if index is None:
        cpu = ort.InferenceSession(str(path), session_options(1),
                                   providers=["CPUExecutionProvider"])

        def run_cpu() -> float:
            t0 = time.thread_time()
            cpu.run(None, feeds)
            return (time.thread_time() - t0) * 1e3

        return run_cpu
    session = open_session(str(path), session_options(1), [
        ("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"], str(path))
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", index))
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda", index)

    def run_gpu() -> float:
        t0 = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return (time.perf_counter() - t0) * 1e3

    return run_gpu


def check(name: str, args: argparse.Namespace, work: Path,
          index: int | None) -> dict[str, Any]:
    from onnx_partition import models  # torch: imported only once CUDA is known to be there

    model = models.export(name, work / f"{name}.onnx", size=args.size)
    graph = load(model, batch_size=args.batch_size)
    began = time.perf_counter()
    result = profile_model(graph, device=args.device, repeats=args.repeats,
                           cache_dir=work / "cache")
    seconds = time.perf_counter() - began
    costs = work / f"{name}-costs.json"
    save_profile(result, costs)
    plan_dir = work / f"{name}-plan"
    device = gpu(here_gpu(index)[1]) if index is not None else measured_cpu()
    plan = partition(model, args.stages, plan_dir, costs=costs, batch_size=args.batch_size,
                     device=device)
    env = dict(input_feeds(graph))
    runners = []
    for stage in plan.stages:
        path = plan_dir / stage.file
        cpu = ort.InferenceSession(str(path), session_options(1),
                                   providers=["CPUExecutionProvider"])
        feeds = {n: env[n] for n in stage.inputs}
        env.update(zip(stage.outputs, cpu.run(stage.outputs, feeds)))
        runners.append(stage_runner(path, feeds, index))
    times: list[list[float]] = [[] for _ in runners]
    for round_ in range(3 + args.repeats):  # interleaved: a burst of load hits every stage
        for k, run in enumerate(runners):
            elapsed = run()
            if round_ >= 3:
                times[k].append(elapsed)
    stages = []
    for stage, stage_times in zip(plan.stages, times):
        measured = statistics.median(stage_times)
        predicted = stage.predicted.compute_ms if stage.predicted else 0.0
        stages.append({"stage": stage.index, "nodes": len(stage.nodes),
                       "predicted_ms": predicted, "measured_ms": measured})
    return {"recipe": name, "nodes": len(graph.nodes), "profile_s": seconds,
            "unmeasured": result.settings.get("signature_model_error"),
            "signatures": result.unique_signatures, "raw_sum_ms": result.raw_sum_ms,
            "whole_model_ms": result.whole_model_ms, "stages": stages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--recipes", nargs="+", default=["gpt", "resnet"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    why = None if args.device == "cpu" else cuda_unavailable(args.device)
    if why is not None:
        print(f"gpu_profile_check: CUDA is not available, nothing checked ({why})")
        return 0
    index = parse_device(args.device)[1]
    here = f"{here_gpu(index)[0]} ({here_gpu(index)[1]})" if index is not None else "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu-profile-check-") as tmp:
        figures = [check(name, args, Path(tmp), index) for name in args.recipes]
    print(table(["recipe", "size", "device (model)", "nodes", "signatures", "profile s",
                 "raw per-node sum ms", "whole model ms", "sum / whole", "unmeasured"],
                [[f["recipe"], args.size, here, f["nodes"], f["signatures"],
                  f"{f['profile_s']:.1f}", f"{f['raw_sum_ms']:.3f}", f"{f['whole_model_ms']:.3f}",
                  f"{f['raw_sum_ms'] / f['whole_model_ms']:.2f}", f["unmeasured"] or "none"]
                 for f in figures]))
    print()
    print(table(["recipe", "stage", "nodes", "predicted ms", "measured alone ms", "error"],
                [[f["recipe"], st["stage"], st["nodes"], f"{st['predicted_ms']:.3f}",
                  f"{st['measured_ms']:.3f}",
                  f"{100 * (st['predicted_ms'] - st['measured_ms']) / st['measured_ms']:+.1f}%"]
                 for f in figures for st in f["stages"]]))
    print(json.dumps({"device": args.device, "onnxruntime": ort.__version__,
                      "batch_size": args.batch_size, "results": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
