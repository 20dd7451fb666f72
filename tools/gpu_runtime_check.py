"""GPU check of the runtime: a recipe's stages on one GPU (several sessions sharing it).

    python tools/gpu_runtime_check.py [--recipe gpt] [--size small] [--stages 4] [--batch-size 16]

Exports the recipe, partitions it with the device model of the GPU it runs on (``--gpu`` names
another: h100, a100-80gb, ...), runs the whole model and the pipelined stages with onnxruntime's
CUDAExecutionProvider on cuda:0, with TF32 off and then on, and prints a Markdown table (the form
docs/benchmarks.md takes as is): per math mode the largest relative error against the whole model
and its tolerance (tools/_gpu.py: 1e-3 in fp32, 2e-2 under TF32), both throughputs and the
plan's predicted bottleneck stage. With a GPU per stage it also runs the plan over NCCL, one
process per stage on cuda:0..S-1, with the host hop and the device hop (IOBinding, DLPack: no
host copies between stages), TF32 as onnxruntime's default. Exits 1 on a mismatch, 0 with a
message where CUDA is not available (CI, CPU machines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

import onnxruntime as ort
import torch
from _gpu import TOLERANCE, cuda_providers, here_gpu, table
from _timing import samples_per_s

from onnx_partition import models
from onnx_partition.cost.devices import gpu
from onnx_partition.graph.ort import open_session, session_options
from onnx_partition.partition import partition
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.infer.check import compare, random_feeds
from onnx_partition.runtime.infer.processes import run_distributed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--gpu", help="device model to plan with (default: the GPU here)")
    args = parser.parse_args()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDA is not available to onnxruntime here (install onnxruntime-gpu on a GPU "
              "machine); nothing to check")
        return 0
    name, key = here_gpu(0)
    key = args.gpu or key
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        model = models.export(args.recipe, Path(tmp) / "model.onnx", size=args.size)
        plan = partition(model, args.stages, Path(tmp) / "plan", batch_size=args.batch_size,
                         device=gpu(key))
        bottleneck = max(s.predicted.compute_ms if s.predicted else 0.0 for s in plan.stages)
        feeds = random_feeds(plan, batch_size=args.batch_size)
        for mode in ("fp32", "tf32"):
            providers = cuda_providers(0, tf32=mode == "tf32")
            whole = open_session(str(model), session_options(1), providers, "the whole model")
            names = [o.name for o in whole.get_outputs()]
            expected = dict(zip(names, whole.run(names, feeds)))
            with PipelineSession(Path(tmp) / "plan", providers=providers,
                                 microbatches=args.microbatches) as session:
                err = compare(dict(zip([o.name for o in session.get_outputs()],
                                       session.run(None, feeds))), expected)
                piped = samples_per_s(partial(session.run, None, feeds), args.batch_size,
                                      args.iterations)
            base = samples_per_s(partial(whole.run, names, feeds), args.batch_size,
                                 args.iterations)
            good = err <= TOLERANCE[mode]
            ok = ok and good
            rows.append([args.recipe, args.size, f"{name} ({key})", args.stages,
                         f"{args.batch_size} / {args.microbatches}", mode, f"{err:.1e}",
                         f"{TOLERANCE[mode]:.0e}", "OK" if good else "MISMATCH",
                         f"{base:.1f}", f"{piped:.1f}", f"{piped / base:.2f}x",
                         f"{bottleneck:.3f}"])
        count = torch.cuda.device_count()
        if count >= args.stages:
            plan_file = Path(tmp) / "plan" / "plan.json"
            raw = json.loads(plan_file.read_text())
            for k, stage in enumerate(raw["stages"]):
                stage["devices"] = [f"cuda:{k}"]
            plan_file.write_text(json.dumps(raw))
            for hop in ("host", "device"):
                outputs, stats = run_distributed(Path(tmp) / "plan", feeds,
                                                 microbatches=args.microbatches,
                                                 iterations=args.iterations, backend="nccl",
                                                 hop=hop)
                err = compare(dict(zip([o.name for o in plan.outputs], outputs)), expected)
                good = err <= TOLERANCE["tf32"]
                ok = ok and good
                steady = stats.throughput_per_s()[1:] or stats.throughput_per_s()
                copies = sum(sum(c.values()) for c in stats.copies.values())
                rows.append([args.recipe, args.size, f"{name} ({key})", args.stages,
                             f"{args.batch_size} / {args.microbatches}",
                             f"tf32, nccl, {hop} hop ({copies} copies)", f"{err:.1e}",
                             f"{TOLERANCE['tf32']:.0e}", "OK" if good else "MISMATCH",
                             f"{base:.1f}", f"{statistics.median(steady):.1f}",
                             f"{statistics.median(steady) / base:.2f}x", f"{bottleneck:.3f}"])
    print(table(["recipe", "size", "GPU (device model)", "stages", "batch / micro-batches",
                 "math", "max rel. error", "tolerance", "check", "whole samples/s",
                 "stages samples/s", "stages / whole", "predicted bottleneck ms"], rows))
    print("(rows without nccl: one GPU runs every stage, so no speed-up is expected)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
