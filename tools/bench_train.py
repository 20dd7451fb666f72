"""Training throughput of a plan against the whole model in one process and the uniform split,
and measured iteration time against the simulator's, on this machine (CPU, gloo).

    python tools/bench_train.py [--model gpt] [--size small] [--stages 2] [--batch-size 2]
        [--microbatches 8] [--steps 6] [--repeats 2] [--whole-threads 1 2] [--workdir DIR]
        [--schedule 1f1b|gpipe]

Exports the recipe with its program, profiles it as it trains (``profile --mode train``:
torch eager per FX unit, forward and backward, one thread, ``--batch-size`` rows: one
micro-batch), partitions it in train mode with those costs twice (our DP and the ``uniform``
baseline, equal operator counts), then trains each plan with ``onnx-partition train``'s
engine (one process per stage, one torch thread each; ``--repeats`` runs per plan, the
plans taking turns, the fastest run shown), and the whole program in one process with one
torch thread and with as many as the plan has ranks (``--whole-threads``; the second is what a
user with those cores runs instead), ``--steps`` steps of ``--microbatches`` micro-batches,
SGD. The first step is left out of every figure. Columns: samples/s; measured ms per step;
the simulator's ms per step from the plan's profiled costs and from the stage times measured
in the run (``measured / simulated`` is the target: within 15%).
Row (c) is torch.distributed.pipelining's own front end on the same recipe module, batch and
steps: ``pipeline()`` with a ``SplitPoint.BEGINNING`` at the transformer block where our DP
plan's stage 1 begins (the block holding stage 1's first parameters), one gloo process per
stage, one torch thread each, ``Schedule1F1B`` over the same micro-batches, cross-entropy, SGD;
the last column of every pipelined row is ours / torch pipelining in samples/s.
Row (d) is ``train --engine torch`` on our DP plan (our stage modules and cut, run by
torch pipelining's ``PipelineStage`` and schedule; same batch, steps, SGD), taking turns with
the others; the line after the table gives ours / (d) in samples/s.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import tempfile
import time
from pathlib import Path

import onnx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from onnx_partition import models
from onnx_partition.cost.profile.torch_ops import profile_train_to_file
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.modules import whole_module
from onnx_partition.runtime.train.optim import make_optimizer
from onnx_partition.runtime.train.rank_io import microbatch
from onnx_partition.runtime.train.results import TrainStats
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan


def whole_steps(plan_dir: Path, rows: int, count: int, steps: int, threads: int) -> list[float]:
    """ms per step of the whole program in this process (gradient accumulation)."""
    torch.set_num_threads(threads)
    plan = read_plan(plan_dir)
    module = whole_module(plan_dir).train()
    task = task_for(plan_dir)
    opt = make_optimizer("sgd", module.parameters(), 0.01)
    names = [o.name for o in plan.outputs]
    times = []
    for step in range(steps):
        inputs, targets = synthetic_batch(task.make_batch, rows * count, 0, step)
        began = time.perf_counter()
        opt.zero_grad()
        for m in range(count):
            x, y = microbatch(inputs, m, count), microbatch(targets, m, count)
            out = module(*[x[s.name] for s in plan.inputs])
            (task.loss_fn(dict(zip(names, out)), y) / count).backward()
        opt.step()
        times.append((time.perf_counter() - began) * 1000.0)
    return times


def block_cut(plan_dir: Path) -> str:
    """The module FQN (``blocks.K``) where stage 1 of a 2-stage plan begins: the lowest block
    index among stage 1's parameters (initializers of its stage file)."""
    plan = read_plan(plan_dir)
    model = onnx.load(str(plan_dir / plan.stages[1].file), load_external_data=False)
    found = [int(m.group(1)) for i in model.graph.initializer
             if (m := re.match(r"blocks\.(\d+)\.", i.name))]
    return f"blocks.{min(found)}"


def _torch_rank(rank: int, port: int, name: str, size: str, cut: str, rows: int, count: int,
                steps: int, out: str) -> None:
    """One stage of torch pipelining's front end (see the module docstring)."""
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    module = models.build(name, size, batch_size=rows).module.train().requires_grad_(True)
    ids = models.build(name, size, batch_size=rows).inputs["input_ids"]
    pipe = pipeline(module, mb_args=(ids,), split_spec={cut: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    vocab = module.head.out_features

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    schedule = Schedule1F1B(stage, n_microbatches=count, loss_fn=loss_fn)
    opt = make_optimizer("sgd", stage.submod.parameters(), 0.01)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (rows * count, ids.shape[1]), generator=generator)
        y = torch.randint(0, vocab, (rows * count, ids.shape[1]), generator=generator)
        dist.barrier()
        began = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        dist.barrier()
        times.append((time.perf_counter() - began) * 1000.0)
    if rank == 0:
        Path(out).write_text(" ".join(f"{t:.3f}" for t in times))
    dist.destroy_process_group()


def torch_pipelining_steps(name: str, size: str, cut: str, rows: int, count: int,
                           steps: int) -> list[float]:
    """ms per step of torch pipelining's front end, 2 processes (rank 0's clock)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times")
        mp.spawn(_torch_rank, args=(port, name, size, cut, rows, count, steps, out), nprocs=2)
        return [float(t) for t in Path(out).read_text().split()]


def row(name: str, rows: int, ms: float, stats: TrainStats | None,
        torch_ms: float | None = None) -> str:
    rate = rows / ms * 1000.0
    ratio = f"{torch_ms / ms:.2f}" if torch_ms else "-"
    if stats is None:
        return f"| {name} | {rate:.1f} | {ms:.1f} | - | - | - | - | - |"
    return (f"| {name} | {rate:.1f} | {ms:.1f} | {stats.simulated_ms:.1f} | "
            f"{ms / stats.simulated_ms:.2f} | {stats.calibrated_ms:.1f} | "
            f"{ms / stats.calibrated_ms:.2f} | {ratio} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each plan, taking turns (the faster one is shown)")
    parser.add_argument("--whole-threads", type=int, nargs="+",
                        help="torch threads of the whole-model runs (default: 1 and the "
                             "plan's ranks, the cores the plan uses)")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    b, m = args.batch_size, args.microbatches
    onnx_file = work / f"{args.model}-{args.size}.onnx"
    began = time.perf_counter()
    if not onnx_file.exists():
        models.export(args.model, onnx_file, size=args.size)
    costs = work / "train-costs.json"
    if not costs.exists():
        profile_train_to_file(onnx_file, costs, batch_size=b, repeats=10, threads=1)
    plans = {}
    for solver in ("dp", "uniform"):
        plans[solver] = work / f"plan-{solver}"
        partition(onnx_file, args.stages, plans[solver], costs=costs, batch_size=b,
                  mode="train", microbatches=m, solver=solver, force=True)
    print(f"prepared in {time.perf_counter() - began:.0f} s: {args.model} {args.size}, "
          f"{args.stages} stages, batch {b * m} = {m} micro-batches x {b} rows, "
          f"{args.steps} steps (first left out), SGD, {args.schedule}")
    for solver, plan_dir in plans.items():
        ops = [len(s.nodes) for s in read_plan(plan_dir).stages]
        print(f"  {solver} split: {ops} ONNX nodes per stage")

    ranks = sum(s.replicas for s in read_plan(plans["dp"]).stages)
    whole_threads = args.whole_threads or sorted({1, ranks})
    whole_ms: dict[int, float] = {}
    lines = ["| configuration | samples/s | measured ms/step | simulated ms (plan costs) | "
             "measured/simulated | simulated ms (measured stage times) | measured/simulated | "
             "ours / torch pipelining (samples/s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for threads in whole_threads:
        ms = whole_steps(plans["dp"], b, m, args.steps, threads)[1:]
        whole_ms[threads] = sum(ms) / len(ms)
        lines.append(row(f"(a) whole model, 1 process, {threads} thread(s)", b * m,
                         whole_ms[threads], None))
    runs: dict[str, list[TrainStats]] = {"dp": [], "uniform": []}
    cut = block_cut(plans["dp"]) if args.stages == 2 else None
    torch_runs: list[float] = []
    engine_runs: list[TrainStats] = []  # (d): --engine torch on our DP plan
    for _ in range(args.repeats):
        for solver in runs:  # taking turns: a slow spell of the machine hits both
            runs[solver].append(train_plan(plans[solver], steps=args.steps, microbatches=m,
                                           batch_size=b, schedule=args.schedule))
        engine_runs.append(train_plan(plans["dp"], steps=args.steps, microbatches=m,
                                      batch_size=b, schedule=args.schedule, engine="torch"))
        if cut is not None:
            ms = torch_pipelining_steps(args.model, args.size, cut, b, m, args.steps)[1:]
            torch_runs.append(sum(ms) / len(ms))
    torch_ms = min(torch_runs) if torch_runs else None
    for solver, label in (("dp", "our plan (DP)"), ("uniform", "(b) uniform split")):
        stats = min(runs[solver], key=lambda st: st.measured_ms)
        lines.append(row(f"{label}, {len(stats.ranks)} processes", b * m, stats.measured_ms,
                         stats, torch_ms))
        print(f"  {label}: ms per step of each run "
              f"{[round(st.measured_ms, 1) for st in runs[solver]]}; best run's per-stage "
              f"forward ms {[round(x, 2) for x in stats.forward_ms]}, "
              f"backward ms {[round(x, 2) for x in stats.backward_ms]}")
    if torch_ms is not None:
        lines.append(row(f"(c) torch pipelining pipeline(), SplitPoint at {cut}, 2 processes",
                         b * m, torch_ms, None))
        print(f"  torch pipelining: ms per step of each run {[round(t, 1) for t in torch_runs]}")
    else:
        lines.append("| (c) torch pipelining | n/a: the bench cuts at one SplitPoint (2 stages) "
                     "|||||||")
    engine = min(engine_runs, key=lambda st: st.measured_ms)
    lines.append(row(f"(d) torch pipelining, --engine torch on our plan, {len(engine.ranks)} "
                     "processes", b * m, engine.measured_ms, engine))
    print(f"  --engine torch: ms per step of each run "
          f"{[round(st.measured_ms, 1) for st in engine_runs]}")
    ours = min(runs["dp"], key=lambda st: st.measured_ms)
    lines.append(f"\nours / (d) --engine torch on the same plan (samples/s): "
                 f"{engine.measured_ms / ours.measured_ms:.2f}")
    print("\n".join(lines))
    best = min(runs["dp"], key=lambda st: st.measured_ms)
    if ranks in whole_ms:  # the fair comparison: the same cores, one process
        print(f"our plan / whole model on {ranks} torch threads (the plan's cores), samples/s: "
              f"{whole_ms[ranks] / best.measured_ms:.2f}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) at the end: {load:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
