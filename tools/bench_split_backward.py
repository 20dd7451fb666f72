"""What the training engine's split backward and recomputation cost, stage by stage.

    python tools/bench_split_backward.py [--recipe gpt] [--size tiny|small] [--stages 3]
        [--rows 4] [--repeats 10] [--threads 1] [--clock wall|cpu]

Exports the recipe, plans it for training in ``--stages`` stages and, for each stage cut from
the program (``runtime.train.modules``), times one micro-batch of ``--rows`` rows as a rank runs
it (``runtime.train.passes``): the whole backward (1F1B's ``B``, ``torch.autograd.backward``),
ZB-H1's input pass ``I`` and weight pass ``W`` (their sum against ``B``: the split's overhead),
and a recomputing stage's rebuild (one more forward); and the bytes autograd saves in the
forward (``saved_tensors_hooks``) keeping the activations against recomputing (the stage keeps
only what it received). Medians of ``--repeats`` runs; every seed gradient is ones; ``--clock
cpu`` times the thread's CPU time (one torch thread computes in the calling thread: what other
processes on a busy machine do not stretch). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from onnx_partition import models
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train import passes
from onnx_partition.runtime.train.modules import StageModule, stage_modules
from onnx_partition.runtime.train.task import task_for


def _saved(run: Callable[[], object]) -> int:
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total[0]


CLOCK = [time.perf_counter]


def _median_ms(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats)) * 1000.0


def _row(stage: StageModule, env: dict[str, torch.Tensor], model_inputs: set[str],
         repeats: int) -> str:
    """One stage's table row; ``env`` gains the stage's outputs."""
    module = stage.module
    params = [p for p in module.parameters() if p.requires_grad]

    def made() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        args_ = [env[n].detach().requires_grad_()
                 if env[n].is_floating_point() and n not in model_inputs else env[n]
                 for n in stage.inputs]
        outs = [o for o in module(*args_) if o.requires_grad]
        return args_, [a for a in args_ if a.requires_grad], outs

    def whole() -> float:
        _, _, outs = made()
        began = CLOCK[0]()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return CLOCK[0]() - began

    split: list[tuple[float, float]] = []

    def halves() -> float:
        _, leaves, outs = made()
        began = CLOCK[0]()
        _, later = passes.input_pass(outs, [torch.ones_like(o) for o in outs], leaves, params)
        mid = CLOCK[0]()
        passes.weight_pass(later)
        split.append((mid - began, CLOCK[0]() - mid))
        return 0.0

    def again() -> float:
        args_, _, _ = made()
        _, rng = passes.kept_forward(lambda: module(*args_), torch.device("cpu"))
        began = CLOCK[0]()
        passes.rebuild(lambda: module(*args_), module, rng)
        return CLOCK[0]() - began

    b_ms = _median_ms(whole, repeats)
    _median_ms(halves, repeats)
    i_ms = statistics.median(i for i, _ in split[1:]) * 1000.0
    w_ms = statistics.median(w for _, w in split[1:]) * 1000.0
    r_ms = _median_ms(again, repeats)
    args_, _, _ = made()
    kept = _saved(lambda: module(*args_))
    received = sum(a.numel() * a.element_size() for a in args_)
    env.update(zip(stage.outputs, (o.detach() for o in module(*args_)), strict=True))
    return (f"| {stage.index} | {b_ms:.2f} | {i_ms:.2f} | {w_ms:.2f} | "
            f"{(i_ms + w_ms) / b_ms:.2f} | {r_ms:.2f} | {kept / 1024:.1f} | "
            f"{received / 1024:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="gpt")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.thread_time
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    model = models.export(args.recipe, root / f"{args.recipe}.onnx", size=args.size)
    partition(model, args.stages, root / "plan", batch_size=args.rows, mode="train",
              schedule="1f1b", recompute="none")
    plan = read_plan(root / "plan")
    model_inputs = {s.name for s in plan.inputs}
    env = dict(task_for(root / "plan").make_batch(args.rows, torch.Generator().manual_seed(0))[0])
    print(f"{args.recipe} {args.size}, {args.stages} stages, {args.rows} rows per micro-batch, "
          f"{args.threads} thread(s), median of {args.repeats}, {args.clock} clock")
    print("| stage | B ms | I ms | W ms | (I+W)/B | rebuild ms | saved kept KiB | "
          "recompute keeps KiB |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in stage_modules(root / "plan", deterministic=True):
        print(_row(stage, env, model_inputs, args.repeats))


if __name__ == "__main__":
    main()
