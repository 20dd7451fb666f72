"""Memory a training run holds against its plan: per plan (each run under the schedule it was
planned for, or ``--schedule``) and micro-batch count, each stage's planned ``memory_bytes``
against the run's measured peak of live tensor storages (the rank's tracker,
:mod:`onnx_partition.runtime.memtrack`; the maximum over the stage's replicas) and the ranks'
peak resident set (VmHWM), and the measured peak's growth from the fewest to the most
micro-batches, in micro-batches' activations (the plan's ``activation_bytes``): under 1F1B
and ZB-H1 a stage holds at most ``p`` micro-batches, so it should stay well under one. Under
ZB-H1 the table also gives the plan's figure without the output gradients kept from ``I`` to
``W`` (``kept_held`` x the stage's kept bytes, counted again from the model's program): the
memory model before it counted them; and every plan's figure without the backward's working
set (``w/o T``: the stage's largest per-node working set), the memory model before issue 33's
working-set term.

    .venv/bin/python tools/bench_memory.py PLAN [PLAN ...] [--microbatches 4 8 32] [--steps 2]
    .venv/bin/python tools/bench_memory.py --hf DIR [--models hf-gpt2 ...] [--schedules ...]
        [--no-labels]

``--hf DIR``: first build the Hugging Face plans in ``DIR`` (``GPT2LMHeadModel``,
``BertForMaskedLM``, ``LlamaForCausalLM`` from configs: 4 layers, 512 wide, 8 heads, 256
tokens, vocabulary 4096, random weights; exported with ``onnx_partition.export``, the labels a
keyword input), each partitioned ``--stages 2 --mode train --batch-size 4 --microbatches 8
--analytic`` once per schedule (the roofline prices the time; memory is what is measured
here), and run those plans too.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from onnx_partition import export
from onnx_partition.cost.saved import counted_per_node
from onnx_partition.graph import load
from onnx_partition.graph_arrays import trainer_loss
from onnx_partition.partition import partition
from onnx_partition.pipeline.memory import kept_held, working_term
from onnx_partition.plan import Plan, read_plan
from onnx_partition.runtime.train.trainer import train_plan

MB = 1e6
#: The Hugging Face models' shape (issue 33's targets).
HF_SHAPE = {"width": 512, "heads": 8, "tokens": 256, "vocab": 4096}


def hf_plans(work: Path, names: list[str], schedules: list[str], labels: bool = True
             ) -> list[Path]:
    """Each model exported once into ``work`` (labels a keyword input; ``labels=False``:
    none, so the trainer's loss runs after the program) and planned once per schedule (module
    docstring); the plan folders, built only where missing."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train_predicted import hf_model

    work.mkdir(parents=True, exist_ok=True)
    folders = []
    for name in names:
        tag = name if labels else f"{name}-nolabels"
        model = work / f"{tag}.onnx"
        if not model.exists():
            ids = torch.randint(0, HF_SHAPE["vocab"], (4, HF_SHAPE["tokens"]),
                                generator=torch.Generator().manual_seed(0))
            export(hf_model(name, **HF_SHAPE), (ids,), model,
                   kwargs={"labels": ids} if labels else None)
        for schedule in schedules:
            folder = work / f"{tag}-{schedule}"
            if not (folder / "plan.json").exists():
                partition(model, 2, folder, batch_size=4, mode="train", microbatches=8,
                          schedule=schedule, analytic=True, check=False, force=True)
            folders.append(folder)
    return folders


def counted_per_stage(folder: Path, plan: Plan) -> tuple[list[float], list[float]]:
    """Each stage's kept-gradient bytes per micro-batch (stage 0 receives no activation: none)
    and its backward's working set (the largest of its nodes'), counted from the plan's
    model."""
    model = (folder / plan.model).resolve()
    graph = load(model, batch_size=plan.rows_per_microbatch)
    counted = counted_per_node(graph, model.with_suffix(".pt2"), loss=trainer_loss(graph))
    index = {n.key: n.index for n in graph.nodes}
    nodes = [[index[n] for n in s.nodes if n in index] for s in plan.stages]
    kept = [float(sum(counted.kept[i] for i in ns)) if k else 0.0
            for k, ns in enumerate(nodes)]
    working = [float(max((counted.working[i] for i in ns), default=0.0)) for ns in nodes]
    return kept, working


def bench(folder: Path, schedule: str, counts: list[int], steps: int) -> None:
    """One plan's table (module docstring)."""
    plan = read_plan(folder)
    acts = [(s.predicted.activation_bytes or 0) if s.predicted else 0 for s in plan.stages]
    counted, working = counted_per_stage(folder, plan)
    kept = counted if schedule == "zb-h1" else [0.0] * len(acts)
    # the working set as planned
    work = [float(working_term(t, plan.schedule or "1f1b"))
            for t, g in zip(working, counted, strict=True)]
    replicas = [s.replicas for s in plan.stages]
    print(f"\n{folder}: planned for {plan.schedule}, run under {schedule}; {len(plan.stages)} "
          f"stages, {plan.rows_per_microbatch} rows per micro-batch, {steps} steps; "
          f"MB = 1e6 bytes")
    print(f"  {'M':>3} {'stage':>5} {'planned MB':>11} {'w/o kept MB':>12} {'w/o T MB':>9} "
          f"{'measured MB':>12} {'ratio':>6} {'w/o kept':>8} {'w/o T':>6} {'VmHWM MB':>9}")
    peaks: dict[int, list[int]] = {}
    for count in counts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a micro-batch count other than the plan's
            stats = train_plan(folder, steps=steps, microbatches=count, schedule=schedule)
        peaks[count] = [m or 0 for m in stats.memory_bytes]
        # the plan's kept micro-batches (the figure is planned at its own count)
        held = kept_held(schedule, replicas, plan.microbatches)
        for k, pred in enumerate(stats.predicted_stages):
            planned = pred.memory_bytes or 0
            before = planned - held[k] * kept[k]
            unworked = planned - work[k]
            got = peaks[count][k]
            print(f"  {count:>3} {k:>5} {planned / MB:>11.2f} {before / MB:>12.2f} "
                  f"{unworked / MB:>9.2f} {got / MB:>12.2f} "
                  f"{got / planned if planned else 0:>6.2f} "
                  f"{got / before if before else 0:>8.2f} "
                  f"{got / unworked if unworked else 0:>6.2f} "
                  f"{(stats.resident_bytes[k] or 0) / MB:>9.1f}")
    low, high = min(peaks), max(peaks)
    for k, act in enumerate(acts):
        grown = peaks[high][k] - peaks[low][k]
        share = f" ({grown / act:+.2f} micro-batches' activations)" if act else ""
        print(f"  stage {k} growth M={low}->{high}: {grown / MB:+.2f} MB{share}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", type=Path, nargs="*")
    parser.add_argument("--hf", type=Path, default=None, metavar="DIR",
                        help="build the Hugging Face plans in DIR and run them too")
    parser.add_argument("--models", nargs="+", default=["hf-gpt2", "hf-bert", "hf-llama"])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"],
                        help="the schedules the --hf plans are planned for")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 32])
    parser.add_argument("--schedule", default=None,
                        help="run every plan under this schedule (default: its own)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-labels", action="store_true",
                        help="export the --hf models without labels: the trainer's loss runs "
                             "after the program")
    args = parser.parse_args()
    plans = list(args.plans)
    if args.hf is not None:
        plans += hf_plans(args.hf, args.models, args.schedules, labels=not args.no_labels)
    if not plans:
        parser.error("no plan: give PLAN folders or --hf DIR")
    for folder in plans:
        schedule = args.schedule or read_plan(folder).schedule or "1f1b"
        bench(folder, schedule, args.microbatches, args.steps)


if __name__ == "__main__":
    main()
