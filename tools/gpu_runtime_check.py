"""GPU check of the runtime: a recipe's stages on one GPU (several sessions sharing it).

    python tools/gpu_runtime_check.py [--recipe gpt] [--size small] [--stages 4] [--batch-size 16]

Exports the recipe, partitions it, runs the whole model and the pipelined stages with
onnxruntime's CUDAExecutionProvider on cuda:0, and prints the largest relative error and both
throughputs. Exits 0 with a message where CUDA is not available (CI, CPU machines).
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial
from pathlib import Path

import onnxruntime as ort
from _timing import samples_per_s

from onnx_partition import models
from onnx_partition.partition import partition
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.infer.check import compare, random_feeds

CUDA = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDA is not available to onnxruntime here (install onnxruntime-gpu on a GPU "
              "machine); nothing to check")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = models.export(args.recipe, Path(tmp) / "model.onnx", size=args.size)
        plan = partition(model, args.stages, Path(tmp) / "plan", batch_size=args.batch_size)
        feeds = random_feeds(plan, batch_size=args.batch_size)
        whole = ort.InferenceSession(str(model), providers=CUDA)
        names = [o.name for o in whole.get_outputs()]
        expected = dict(zip(names, whole.run(names, feeds)))
        with PipelineSession(Path(tmp) / "plan", providers=CUDA,
                             microbatches=args.microbatches) as session:
            err = compare(dict(zip(
                    [o.name for o in session.get_outputs()], session.run(None, feeds))), expected)
            piped = samples_per_s(partial(session.run, None, feeds), args.batch_size,
                                  args.iterations)
        base = samples_per_s(partial(whole.run, names, feeds), args.batch_size, args.iterations)
    print(f"{args.recipe} ({args.size}), {args.stages} stages on cuda:0, batch "
          f"{args.batch_size} in {args.microbatches} micro-batches")
    print(f"max relative error vs the whole model on the GPU: {err:.2e} "
          f"({'OK' if err <= 1e-4 else 'MISMATCH'})")
    print(f"whole model {base:.1f} samples/s; pipelined stages {piped:.1f} samples/s "
          f"({piped / base:.2f}x; one GPU, so no speed-up is expected)")
    return 0 if err <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
