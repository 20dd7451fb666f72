"""A train plan's promise against its run: measured / predicted step time, per-stage forward and
backward time and activation bytes, for the recipes and Hugging Face models (issue 20's
targets: step within 15%, activation bytes within 5%).

    python tools/bench_train_predicted.py [--models gpt bert hf-gpt2 ...] [--size small]
        [--stages 2] [--batch-size 2] [--microbatches 4] [--steps 4] [--workdir DIR]
        [--repeats 5] [--no-profile | --default] [--calibrate] [--breakdown]
        [--width 128] [--heads 4] [--tokens 32] [--vocab 1000]

Per model: export it with its program (recipes at ``--size``; ``hf-gpt2``, ``hf-bert``,
``hf-llama``: Hugging Face models from configs, 4 layers, 128 wide, 32 tokens, random weights,
or as ``--width --heads --tokens --vocab`` say),
``profile --mode train`` it (torch eager per FX unit, one thread: what each rank uses, at the
micro-batch's rows; the engine probe, ``engine.probe``, as the command line runs it),
``partition --mode train --stages S --costs`` with those costs (``--no-profile``: the
analytic costs, for comparison; ``--default``: no costs, as ``partition`` prices a train
plan for this CPU by default, its cached profile), then ``train`` the plan with one process
per stage over gloo for ``--steps`` steps (the first two left out of the times) and print
``train --json``'s ``ratio``: measured / predicted for the step (``iteration_ms``) and, per
stage, ``forward_ms``, ``backward_ms`` (wall), the same compute's thread CPU time against the
same predictions (what other processes on a busy machine do not stretch) and
``activation_bytes`` (the saved-tensor hook's count in the run against plan.json's). A model
that fails prints its one-line error and the table goes on. Times are of this machine as it
is: say its load with the figures. Each row also sets the run against the plan priced without
the engine's own work (no ``step_ms``, ``accumulate_ms`` or ``action_ms``, hops by the link
model: how plans were priced before ``cost/engine_price.py``). ``--calibrate``: a second row per
model, the plan after ``profile --plan``. ``--breakdown``: a second table, where each rank's step
went.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from onnx_partition import export, models
from onnx_partition.calibrate.recut import calibrate_plan
from onnx_partition.cost.profile.torch_ops import profile_train_to_file
from onnx_partition.errors import one_line
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.pipeline.schedules import TRAIN_NAMES, build
from onnx_partition.pipeline.simulate import PipelineCosts, simulate
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.overheads import rank_overheads
from onnx_partition.runtime.train.probe import probe_engine
from onnx_partition.runtime.train.results import comparison
from onnx_partition.runtime.train.trainer import train_plan

HF = ("hf-gpt2", "hf-bert", "hf-llama")
#: The Hugging Face models' shape: 4 layers; width, heads, tokens and vocabulary by the options.
SHAPE = {"width": 128, "heads": 4, "tokens": 32, "vocab": 1000}


def hf_model(name: str, width: int, heads: int, tokens: int, vocab: int) -> torch.nn.Module:
    """A 4-layer Hugging Face model of the family (random weights, seeded), ``width`` wide
    (MLP 4x), ``heads`` heads (Llama: half as many key-value heads), ``tokens`` positions."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    shape: dict[str, Any] = {"num_hidden_layers": 4, "hidden_size": width,
                             "num_attention_heads": heads, "intermediate_size": 4 * width}
    if name == "hf-gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=4, n_embd=width, n_head=heads, n_positions=tokens, vocab_size=vocab,
            bos_token_id=0, eos_token_id=0))
    if name == "hf-bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=vocab, max_position_embeddings=tokens, **shape))
    if name == "hf-llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, max_position_embeddings=tokens,
            num_key_value_heads=max(1, heads // 2), **shape))
    raise ValueError(name)


def exported(name: str, size: str, rows: int, work: Path) -> Path:
    """The model's ONNX file (its program beside it), exported once into ``work``."""
    if name in HF:
        tag = "-".join(str(SHAPE[k]) for k in ("width", "heads", "tokens", "vocab"))
        path = work / f"{name}-{tag}.onnx"
        if not path.exists():
            ids = torch.randint(0, SHAPE["vocab"], (rows, SHAPE["tokens"]),
                                generator=torch.Generator().manual_seed(0))
            export(hf_model(name, **SHAPE), (ids,), path)
        return path
    path = work / f"{name}-{size}.onnx"
    if not path.exists():
        models.export(name, path, size=size)
    return path


def measure(name: str, args: argparse.Namespace, work: Path, calibrated: bool = False) -> str:
    """The model's table row (or its one-line failure); ``calibrated``: the plan after
    ``profile --plan`` (its stage modules and the engine's work measured)."""
    b, m = args.batch_size, args.microbatches
    began = time.perf_counter()
    try:
        model = exported(name, args.size, b, work)
        costs = None
        if not args.no_profile and not args.default:
            costs = work / f"{model.stem}-train-costs-b{b}.json"
            if not costs.exists():
                profile_train_to_file(model, costs, batch_size=b, repeats=args.repeats,
                                      threads=1, probe=probe_engine)
        how = "default" if args.default else "profiled" if costs else "analytic"
        plan_dir = work / f"{model.stem}-plan-{how}-b{b}-m{m}"
        if not calibrated or not plan_dir.is_dir():  # the default: the cached profile
            partition(model, args.stages, plan_dir, costs=costs, batch_size=b, mode="train",
                      microbatches=m, check=False, force=True,
                      analytic=None if args.default else costs is None)
        if calibrated:
            out = work / f"{model.stem}-plan-calibrated"
            calibrate_plan(plan_dir, out=out, repeats=args.repeats)
            plan_dir, name = out, f"{name} (profile --plan)"
        prepared = time.perf_counter() - began
        stats = train_plan(plan_dir, steps=args.steps, microbatches=m, batch_size=b)
    except Exception as exc:  # one model's failure is one row
        return f"| {name} | failed: {one_line(exc)} |||||||||||"
    body = comparison(stats)
    ratio, measured, predicted = body["ratio"], body["measured"], body["predicted"]
    if args.breakdown:
        BREAKDOWNS.append(breakdown(name, stats))
        ACTIONS.append(per_action(name, plan_dir, stats, measured["iteration_ms"],
                                  predicted["iteration_ms"], m))

    def fmt(values: list[float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.2f}" for v in values)

    stages = ratio["stages"]
    acts = [s["activation_bytes"] for s in stages]
    bare = without_engine(plan_dir, stats.schedule, m)
    cpu = on_cpu_compute(plan_dir, stats, m)
    return (f"| {name} | {measured['iteration_ms']:.1f} | {bare:.1f} | "
            f"{measured['iteration_ms'] / bare:.2f} | {predicted['iteration_ms']:.1f} | "
            f"**{ratio['iteration_ms']:.2f}** | {cpu / predicted['iteration_ms']:.2f} | "
            f"{measured['iteration_ms'] / cpu:.2f} | {fmt([s['forward_ms'] for s in stages])} | "
            f"{fmt([s['backward_ms'] for s in stages])} | "
            f"{fmt([s['forward_cpu_ms'] for s in stages])} | "
            f"{fmt([s['backward_cpu_ms'] for s in stages])} | "
            f"{' / '.join('-' if a is None else f'{a:.3f}' for a in acts)} | "
            f"{prepared:.0f} s |")


BREAKDOWNS: list[str] = []
ACTIONS: list[str] = []


def per_action(name: str, plan_dir: Path, stats: Any, measured: float, predicted: float,
               microbatches: int) -> str:
    """The engine's work per action: each rank's "other action work" and "between actions"
    (:func:`breakdown`) over its actions a step (``runtime.train.overheads``), against the
    plan's ``action_ms``; and the predicted step with and without ``action_ms`` against the
    measured one."""
    plan = read_plan(plan_dir)
    priced = plan.simulator_costs.action_ms or [0.0] * len(plan.stages)
    plan.simulator_costs.action_ms = None
    sched = stats.schedule if stats.schedule in TRAIN_NAMES else "1f1b"
    bare = simulate_plan(plan, schedule=sched, microbatches=microbatches)[0].iteration_ms
    work = [rank_overheads(r) for r in stats.ranks]
    measured_work = " / ".join(f"{o.action_ms:.2f} ({o.actions})" for o in work)
    return (f"| {name} | {stats.schedule} | {measured_work} | "
            f"{' / '.join(f'{a:g}' for a in priced)} | {measured:.1f} | {bare:.1f} | "
            f"{measured / bare:.2f} | {predicted:.1f} | **{measured / predicted:.2f}** |")


def on_cpu_compute(plan_dir: Path, stats: Any, microbatches: int) -> float:
    """The plan's simulation with its stages' compute replaced by what the run's compute cost in
    thread CPU time (forward, and backward with its accumulation; the engine's per-step work and
    hops as priced): the step as predicted had the compute been priced right and nothing else
    taken the cores. Over the prediction: the compute's own misprice; the measured step over
    it: the load's stretch and whatever is still unpriced."""
    plan = read_plan(plan_dir)
    name = stats.schedule if stats.schedule in TRAIN_NAMES else "1f1b"
    _, costs = simulate_plan(plan, schedule=name, microbatches=microbatches)
    fwd = stats.forward_cpu_ms or stats.forward_ms
    bwd = stats.backward_cpu_ms or stats.backward_ms
    stages = []
    for k, st in enumerate(costs.stages):
        i, _ = st.split()
        share = i / st.backward_ms if st.backward_ms else 0.5
        stages.append(replace(st, forward_ms=fwd[k], backward_ms=bwd[k],
                              backward_input_ms=bwd[k] * share, backward_weight_ms=None,
                              accumulate_ms=0.0))
    sched = build(name, [s.replicas for s in costs.stages], microbatches)
    return simulate(sched, PipelineCosts(stages, costs.send_ms)).iteration_ms


def without_engine(plan_dir: Path, schedule: str, microbatches: int) -> float:
    """The plan's simulated step as priced before the engine's work was (no ``step_ms``,
    ``accumulate_ms`` or ``action_ms``; ``send_ms`` from the plan's link model at each hop's
    bytes): the "before" column (for a calibrated plan, its measured stage times without the
    engine's work)."""
    plan = read_plan(plan_dir)
    sim = plan.simulator_costs
    sim.step_ms = sim.accumulate_ms = sim.action_ms = None
    link = plan.link
    if sim.hop_bytes is not None and link is not None:
        bw = float(link.bandwidth_gbps)
        sim.send_ms = [float(link.latency_ms) + (b / (bw * 1e6) if bw > 0 else 0.0)
                       for b in sim.hop_bytes]
    name = schedule if schedule in TRAIN_NAMES else "1f1b"
    return simulate_plan(plan, schedule=name, microbatches=microbatches)[0].iteration_ms


def breakdown(name: str, stats: Any) -> str:
    """Where each rank's step went (ms per step, means over the steady steps): compute
    (forward with the loss, backward), blocked in receives, the rest of its actions (send
    copies, headers, posting), the tail (sends awaited, gradient sums, the norm's all-reduce:
    a barrier, the optimizer step) and the rest (the step's closing all-reduce)."""
    rows = []
    for r in stats.ranks:
        steady = slice(1, None) if len(r.step_ms) > 1 else slice(None)

        def mean(values: list[float], steady: slice = steady) -> float:
            return sum(values[steady]) / max(1, len(values[steady]))

        acts = [sum(e - s for _, s, e, _ in spans) for spans in r.spans]
        blocked = [sum(b for *_, b in spans) for spans in r.spans]
        last = [spans[-1][2] for spans in r.spans]
        parts = {k: mean([t[k] for t in r.tail]) for k in r.tail[0]}
        tail = [sum(t.values()) for t in r.tail]
        rest = [s - a - b for s, a, b in zip(r.step_ms, last, tail)]
        compute = mean(r.forward_ms) + mean(r.backward_ms)
        rows.append(f"| {name} | {r.stage} | {mean(r.step_ms):.1f} | {mean(r.forward_ms):.1f} | "
                    f"{mean(r.backward_ms):.1f} | {mean(blocked):.1f} | "
                    f"{mean(acts) - compute - mean(blocked):.1f} | "
                    f"{mean(last) - mean(acts):.1f} | "
                    + " | ".join(f"{parts[k]:.1f}" for k in parts) + f" | {mean(rest):.1f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*models.RECIPES, "hf-gpt2"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="profile's timed repetitions")
    parser.add_argument("--no-profile", action="store_true",
                        help="price the plans analytically (no profile --mode train)")
    parser.add_argument("--default", action="store_true",
                        help="price each plan as partition does by default: measured on this "
                             "CPU by its cached profile (profiled once into the profile "
                             "cache, $ONNX_PARTITION_CACHE)")
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key}", type=int, default=value,
                            help=f"the Hugging Face models' {key} (default {value})")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--calibrate", action="store_true",
                        help="also train each plan after profile --plan (a second row)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print where each rank's step went (compute, receives, "
                             "send work, the tail: sends awaited, gradient sums, norm, "
                             "optimizer)")
    args = parser.parse_args()
    SHAPE.update({k: getattr(args, k) for k in SHAPE})
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-predicted-"))
    work.mkdir(parents=True, exist_ok=True)
    priced = ("the default (measured on this CPU, cached)" if args.default
              else "analytic costs" if args.no_profile else "profile --mode train")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.stages} stages, {args.microbatches} micro-batches x {args.batch_size} rows, "
          f"{args.steps} steps (first two left out), the optimizer and schedule plan.json records, "
          f"one torch thread per rank, gloo; "
          f"priced by {priced}; "
          f"Hugging Face models {SHAPE}; "
          f"{os.cpu_count()} CPUs, load average {load:.1f} at the start, torch "
          f"{torch.__version__}")
    print("\n| model | measured ms/step | predicted before (no engine terms) | m/p before | "
          "predicted ms/step | step measured/predicted | predicted on the run's CPU compute / "
          "predicted | measured / predicted on the run's CPU compute | "
          "forward m/p per stage | backward m/p per stage | forward CPU time/p | "
          "backward CPU time/p | activation bytes m/p per stage | prepare |")
    print("| --- |" + " ---: |" * 13)
    for name in args.models:
        print(measure(name, args, work), flush=True)
        if args.calibrate:
            print(measure(name, args, work, calibrated=True), flush=True)
    if BREAKDOWNS:
        print("\n| model | stage | step | forward | backward | blocked in receives | other "
              "action work | between actions | sends awaited | gradient sums | norm all-reduce "
              "| optimizer | closing all-reduce |")
        print("| --- |" + " ---: |" * 12)
        print("\n".join(BREAKDOWNS))
        print("\n| model | schedule | measured work per action, ms (actions) per rank | "
              "action_ms priced | measured ms/step | predicted without action_ms | m/p | "
              "predicted with | **m/p** |")
        print("| --- |" + " ---: |" * 8)
        print("\n".join(ACTIONS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
