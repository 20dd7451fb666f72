"""GPU check of training: a recipe's train plan trained over NCCL, one GPU per stage.

    python tools/gpu_train_check.py [--recipe gpt] [--size small] [--stages 2] [--batch-size 8]
        [--microbatches 8] [--steps 6]

Exports the recipe with its program and partitions it in train mode into ``--stages`` stages
on a one-machine cluster of this GPU (``cuda:0..S-1``; NCCL needs a GPU per rank), priced with
the analytic model of the GPU it runs on (:func:`onnx_partition.cost.devices.gpu_key` of
``torch.cuda.get_device_name``, float32 matrix products at fp32: torch's default, and the
check's). Trains it with ``--check`` (TF32 off: gradients after the first backward, then the
parameters, against single-process training on the CPU, within the precision's tolerance),
then again without the check for the figures; also the whole program on ``cuda:0`` in one
process. Prints a markdown table docs/benchmarks.md can take as is. Exits 0 with a message
where CUDA or enough GPUs are missing (CI, CPU machines).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from onnx_partition import models
from onnx_partition.cli.summary.train import format_train
from onnx_partition.cost.cluster import Cluster
from onnx_partition.cost.devices import DEFAULT_GPU, GPUS, gpu, gpu_key
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.modules import whole_module
from onnx_partition.runtime.train.optim import make_optimizer
from onnx_partition.runtime.train.rank_io import microbatch
from onnx_partition.runtime.train.results import TrainStats
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan

HEADER = ("| GPU | model | stages | check | samples/s | measured ms/step | simulated ms (plan) "
          "| measured/simulated | whole model, 1 GPU, samples/s |\n"
          "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")


def table_row(gpu_name: str, model: str, stages: int, checked: TrainStats, stats: TrainStats,
              whole_rate: float) -> str:
    """One row under :data:`HEADER`."""
    verdict = "OK" if not checked.mismatches else f"MISMATCH ({len(checked.mismatches)})"
    return (f"| {gpu_name} | {model} | {stages} | {verdict} | {stats.samples_per_s:.1f} | "
            f"{stats.measured_ms:.2f} | {stats.simulated_ms:.2f} | "
            f"{stats.measured_ms / stats.simulated_ms:.2f} | {whole_rate:.1f} |")


def whole_ms(plan_dir: Path, rows: int, count: int, steps: int) -> float:
    """Mean ms per step (the first left out) of the whole program on cuda:0."""
    device = torch.device("cuda", 0)
    plan = read_plan(plan_dir)
    module = whole_module(plan_dir).train().to(device)
    task = task_for(plan_dir)
    opt = make_optimizer("sgd", module.parameters(), 0.01)
    names = [o.name for o in plan.outputs]
    times = []
    for step in range(steps):
        inputs, targets = synthetic_batch(task.make_batch, rows * count, 0, step)
        torch.cuda.synchronize()
        began = time.perf_counter()
        opt.zero_grad()
        for m in range(count):
            x = {n: v.to(device) for n, v in microbatch(inputs, m, count).items()}
            y = {n: v.to(device) for n, v in microbatch(targets, m, count).items()}
            out = module(*[x[s.name] for s in plan.inputs])
            (task.loss_fn(dict(zip(names, out)), y) / count).backward()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1000.0)
    steady = times[1:] or times
    return sum(steady) / len(steady)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available to torch here; nothing to check")
        return 0
    if torch.cuda.device_count() < args.stages:
        print(f"{torch.cuda.device_count()} GPU(s) here; NCCL needs one per rank, so "
              f"{args.stages} stages need {args.stages}: nothing to check")
        return 0
    b, m = args.batch_size, args.microbatches
    with tempfile.TemporaryDirectory(prefix="gpu-train-") as tmp:
        work = Path(tmp)
        onnx_file = models.export(args.recipe, work / "model.onnx", size=args.size)
        plan_dir = work / "plan"
        name = torch.cuda.get_device_name(0)
        key = gpu_key(name)
        if key is None:
            print(f"no spec of {name} in cost/devices.py (known: {', '.join(GPUS)}); "
                  f"planning with {DEFAULT_GPU}'s")
        key = key or DEFAULT_GPU
        cluster = Cluster(machines=1, devices_per_machine=args.stages, kind="cuda", gpu=key)
        plan = partition(onnx_file, args.stages, plan_dir, batch_size=b, mode="train",
                         microbatches=m, cluster=cluster, device=gpu(f"{key}:fp32"))
        print(f"{name}: planned as {key}:fp32, devices "
              f"{[d for s in plan.stages for d in s.devices]}")
        checked = train_plan(plan_dir, steps=3, microbatches=m, batch_size=b, check=True,
                             optimizer="adamw", lr=1e-3)
        print(format_train(checked))
        stats = train_plan(plan_dir, steps=args.steps, microbatches=m, batch_size=b)
        print(format_train(stats))
        ms = whole_ms(plan_dir, b, m, args.steps)
        print(HEADER)
        print(table_row(name, f"{args.recipe} {args.size}, batch {b} x {m}", args.stages,
                        checked, stats, b * m / ms * 1000.0))
        return 1 if checked.mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
