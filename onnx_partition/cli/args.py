"""The ``onnx-partition`` command line's arguments: the parser, with a sub-parser per verb
(export, profile, partition, run, train, simulate, report, demo), the parsers of a torchrun rank
of ``run`` and of ``train`` (:func:`rank_parser`, the same option functions), and input shapes;
the devices ``partition``'s options describe are resolved by :mod:`onnx_partition.request.resolve`
(as the Python API's are). What each verb does is in
:mod:`onnx_partition.cli.verbs`; every numeric option is checked by
:func:`onnx_partition.values.install`. Building a parser imports no runtime or solver (no torch,
onnxruntime or OR-Tools).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from onnx_partition import __version__, values
from onnx_partition.cli.descriptions import DESCRIPTIONS
from onnx_partition.cli.export_args import export_args
from onnx_partition.cost.autocast import PRECISIONS as PLAN_PRECISIONS
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline import schedules
from onnx_partition.plan.contracts import ClusterFields
from onnx_partition.plan.planfile import DEFAULT_MICROBATCHES
from onnx_partition.request.train import KEYWORDS, planned_choices
from onnx_partition.runtime.train.choices import (
    ENGINES,
    LOSSES,
    OPTIMIZERS,
    TORCH_SCHEDULES,
)
from onnx_partition.settings.partition import AUTO, SearchSpec, TrainSpec
from onnx_partition.settings.train import DEFAULTS, TRAIN_FALLBACKS, WEIGHT_DECAY

__all__ = ["RANK_ENTRIES", "TRAIN_FALLBACKS", "build_parser", "chunks_of", "input_shapes_of",
           "nearest", "plan_defaults", "rank_parser", "train_options"]

log = logging.getLogger("onnx_partition")
_TRAIN, _SEARCH = TrainSpec(), SearchSpec()  # partition's defaults, written in settings


def build_parser(commands: Mapping[str, Callable[[argparse.Namespace], int]]
                 ) -> argparse.ArgumentParser:
    """The command line; ``commands`` maps each verb to the function that runs it
    (``args.func``)."""
    parser = _Parser(
        prog="onnx-partition", formatter_class=_Help,
        description="Cut an ONNX model into pipeline stages and run them as a pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _verbosity_args(parser, 0)
    common = argparse.ArgumentParser(add_help=False)
    _verbosity_args(common, argparse.SUPPRESS)  # after the verb too, without resetting them
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB",
                                  help="what to do (each verb has its own --help)",
                                  parser_class=_verb_parser(common))
    for name, summary, add_args in _VERBS:
        p = verbs.add_parser(name, help=summary, description=DESCRIPTIONS[name])
        add_args(p)
        p.set_defaults(func=commands[name])
    return parser


#: The ``python -m`` module that runs one torchrun rank of each verb that has one.
RANK_ENTRIES = {"run": "onnx_partition.runtime.distributed",
                "train": "onnx_partition.train.runtime"}


def rank_parser(verb: str) -> argparse.ArgumentParser:
    """The options of one rank of ``verb`` (run or train) under ``torchrun``
    (:mod:`onnx_partition.cli.torchrun`): the verb's own, less those of a whole run started
    here (--nproc and the like), plus --backend."""
    parser = _Parser(
        prog=f"python -m {RANK_ENTRIES[verb]}", formatter_class=_Help,
        description=f"One rank of `onnx-partition {verb}` across processes or machines: start "
                    "one per stage replica with torchrun.")
    {"run": _run_args, "train": _train_args}[verb](parser, True)
    return parser


# --------------------------------------------------------------------------- reading them


def chunks_of(args: argparse.Namespace) -> int | None:
    """``--chunks``, which only the interleaved schedule takes."""
    if args.chunks is not None and args.schedule != "interleaved":
        raise PartitionError("--chunks needs --schedule interleaved")
    return args.chunks


def input_shapes_of(args: argparse.Namespace) -> dict[str, list[int]]:
    """``--input-shape NAME=2,3,224`` items -> {NAME: [2, 3, 224]}; a clear error otherwise."""
    return dict(values.input_shape(item) for item in args.input_shape)


# --------------------------------------------------------------------------- the parser


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, once: not for the uninformative ones (None, False,
    []) nor where the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, []) or "default" in text:
            return action.help
        return super()._get_help_string(action)


def nearest(word: str, options: list[str]) -> str | None:
    """The option closest to a misspelled ``word`` (``--num-stages`` -> ``--stages``), if
    any is close."""
    name = word.split("=", 1)[0]
    found = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    if not found and name.startswith("--"):  # --batchsize -> --batch-size
        bare = {o.replace("-", ""): o for o in options}
        found = [bare[k] for k in difflib.get_close_matches(name.replace("-", ""), bare, n=1,
                                                              cutoff=0.6)]
    return found[0] if found else None


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (a PartitionError: ``error: ...``, exit code 2, nothing
    else printed): a misspelled option names the nearest, a bad choice lists the choices."""

    def error(self, message: str) -> typing.NoReturn:
        raise PartitionError(f"{self.prog.removeprefix('onnx-partition ')}: {message} "
                             f"(see {self.prog} --help)")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            flag = "/".join(action.option_strings) or action.dest
            near = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise argparse.ArgumentError(
                None, f"{flag} {value!r} is not one of {', '.join(choices)}{hint}")

    def parse_args(  # type: ignore[override]
        self, args: typing.Any = None, namespace: typing.Any = None,
    ) -> argparse.Namespace:
        """As argparse's, but arguments a verb does not take are named by that verb's parser
        (argparse would report them from the command's, with no suggestion)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            verb = getattr(parsed, "verb", None)
            sub = next((a for a in self._actions
                        if isinstance(a, argparse._SubParsersAction)), None)
            target = sub.choices.get(verb) if sub is not None and verb else None
            (target if isinstance(target, _Parser) else self).unknown(extras)
        return parsed

    def unknown(self, extras: list[str]) -> typing.NoReturn:
        """The error of arguments this parser does not take, naming the nearest option."""
        options = [o for a in self._actions for o in a.option_strings]
        flags = [e for e in extras if e.startswith("-")]
        if not flags:
            self.error(f"unexpected argument{'s' * (len(extras) != 1)} {' '.join(extras)}")
        near = nearest(flags[0], options)
        hint = f"; did you mean {near}?" if near else ""
        self.error(f"unknown option {flags[0].split('=', 1)[0]}{hint}")


def _verb_parser(common: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    """Verb parsers that show defaults, take -q/-v after the verb too and report argument
    errors in one line."""

    class VerbParser(_Parser):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.setdefault("formatter_class", _Help)
            kwargs.setdefault("parents", [common])
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    return VerbParser


def _schedule_help(names: tuple[str, ...]) -> str:
    """The registry's description of each of ``names``, for a --schedule help."""
    return "; ".join(f"{n}: {schedules.REGISTRY[n].description}" for n in names)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", choices=schedules.NAMES,
                   help="default: the one the plan was planned for (plan.json's schedule; "
                        "older plans: 1f1b for training, infer otherwise). "
                        + _schedule_help(schedules.NAMES))
    p.add_argument("--microbatches", type=int, help="micro-batches (default: the plan's)")
    p.add_argument("--no-verify", action="store_true",
                   help="check the plan folder's file sizes only, not their sha256")
    p.add_argument("--chunks", type=int,
                   help="model chunks per device for --schedule interleaved (default 2); "
                        "must divide the stage count")


def _json_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout instead of text (plan.json's field "
                        "names)")


def _verbosity_args(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("-q", "--quiet", action="count", default=default,
                   help="print only results, warnings and errors (no progress lines or bars)")
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="also print debug lines")


def _shape_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an input's shape (repeatable)")
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch: fixes a symbolic leading (batch) dim")


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, nargs="?", help="the ONNX model to measure")
    p.add_argument("--plan", type=Path, metavar="PLAN",
                   help="calibrate the plan folder PLAN instead: time each stage alone and all "
                        "side by side (as run), re-price, re-cut if that moves the optimum "
                        "(at most --rounds times), write the plan in place (or to -o)")
    p.add_argument("--rounds", type=int, default=3, help="with --plan: most re-cuts")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    _shape_args(p)
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median taken)")
    p.add_argument("--threads", type=int, default=1,
                   help="onnxruntime intra-op threads (train: torch threads, as each rank)")
    p.add_argument("--mode", choices=("infer", "train"), default="infer",
                   help="infer: each node's forward in onnxruntime; train: each torch op's "
                        "forward and backward in torch eager, from the program MODEL.pt2")
    p.add_argument("--precision", default="fp32", choices=PLAN_PRECISIONS,
                   help="--mode train: measure under autocast to bf16/fp16 (default fp32); the "
                        "costs file records it")
    p.add_argument("-o", "--output", type=Path,
                   help="costs.json to write (with --plan: the plan folder, default PLAN)")


def _add_shard_option(plan: argparse._ArgumentGroup) -> None:
    """``partition --shard-optimizer`` (ZeRO-1 over each stage's replicas)."""
    plan.add_argument("--shard-optimizer", action="store_true",
                      help="--mode train: a stage on r replicas holds 1/r of its optimizer "
                           "state (ZeRO-1; plan.json's stages[i].shard, which train follows)")


def _costs_args(model: argparse._ArgumentGroup) -> None:
    """``partition``'s ``--costs`` and ``--analytic``: what prices the nodes."""
    model.add_argument("--costs", action="append", metavar="[KIND=]FILE",
                       help="costs.json (contract format); else a train plan for this CPU "
                            "is measured (see --analytic) and the rest analytic. A fleet "
                            "(cluster.json with groups) takes one per GPU kind: --costs "
                            "a100-80gb=A.json --costs v100=V.json (kinds without one: their "
                            "roofline)")
    model.add_argument("--analytic", action="store_true",
                       help="--mode train for this CPU: price by the analytic roofline instead "
                            "of measuring (default: profile --mode train on this CPU once, "
                            "cached, so the same command plans the same; "
                            "$ONNX_PARTITION_TRAIN_PRICING=analytic sets this default)")


def _partition_args(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("the model and its costs")
    model.add_argument("model", type=Path, help="the ONNX model to cut")
    _costs_args(model)
    _shape_args(model)
    model.add_argument("--no-program", action="store_true",
                       help="with --mode train: plan a model that has no exported program "
                            "(MODEL.pt2) beside it; `train` cannot run such a plan")
    plan = p.add_argument_group("every plan (--stages and cluster plans alike)")
    plan.add_argument("--stages", "-s", type=int,
                      help="number of pipeline stages (with a cluster: fix the depth, else "
                           "chosen)")
    plan.add_argument("--mode", default=_SEARCH.mode, choices=("infer", "train"),
                      help="infer: forward only; train: forward, backward, all-reduce, the "
                           "schedule's memory (needs the model's program MODEL.pt2, see "
                           "--no-program)")
    plan.add_argument("--microbatches", type=int, default=_TRAIN.microbatches,
                      help="micro-batches per iteration")
    plan.add_argument("--schedule", choices=(AUTO, *schedules.PLANNED_NAMES),
                      help="--mode train: the pipeline schedule to plan for (default "
                           f"{_TRAIN.schedule}: plan for each and keep the fastest simulated "
                           "plan). " + _schedule_help(schedules.PLANNED_NAMES))
    plan.add_argument("--precision", default=_TRAIN.precision, choices=PLAN_PRECISIONS,
                      help="--mode train: the precision the run trains in (default "
                           f"{_TRAIN.precision}; bf16/fp16: autocast over fp32 parameters, "
                           "activations counted as "
                           "autocast saves them, a GPU's matrix products at its half peak); "
                           "plan.json records it and `train` defaults to it")
    plan.add_argument("--recompute", choices=(AUTO, "none", "all"),
                      help="--mode train: which stages keep only their inputs and recompute "
                           f"their forward in backward (default {_TRAIN.recompute}: those "
                           "that would not fit the device memory otherwise); plan.json marks "
                           "them")
    _add_shard_option(plan)
    plan.add_argument("--bandwidth", type=float,
                      help="link bandwidth between stages in GB/s, and between the devices of "
                           "a machine with --devices (0 = free; default: a named GPU's "
                           "datasheet link, NVLink or PCIe, else 10)")
    plan.add_argument("--latency", type=float,
                      help="link latency in ms (default: a named GPU's link's, else 0.02)")
    plan.add_argument("--device-kind", choices=("cpu", "cuda"),
                      help="the devices the plan is for (cuda: stage files placed on cuda:N; "
                           "default cpu, cuda with --gpu)")
    plan.add_argument("--gpu", help="GPU of the analytic costs, implies --device-kind cuda: "
                      "v100, a100-40gb, a100-80gb, h100 (the default), h200, l4; "
                      "NAME:fp32|tf32|bf16|fp16 sets the math of fp32 graphs")
    plan.add_argument("--cpu-tflops", type=float, metavar="X",
                      help="pin the analytic CPU's dense peak at X TFLOP/s (default: measured "
                           "once per machine and cached in $XDG_CACHE_HOME/onnx-partition)")
    plan.add_argument("--cpu-gbps", type=float, metavar="Y",
                      help="with --cpu-tflops: the pinned CPU's memory bandwidth in GB/s "
                           "(default 10)")
    plan.add_argument("--strict-costs", action="store_true", help="refuse a costs file "
                      "measured on another device kind than the plan's")
    search = p.add_argument_group("plain pipelines (--stages without a cluster)")
    search.add_argument("--order", default=_SEARCH.ordering,
                        choices=("auto", "topo", "dfs", "minlive", "cluster"),
                        help="how to sequence the DAG before the DP (auto: try all, keep the "
                             "best)")
    search.add_argument("--solver", default=_SEARCH.solver,
                        choices=("dp", "ilp", "uniform", "parameters", "time"),
                        help="dp, ilp (exact OR-Tools CP-SAT over the DAG, seeded by dp), or a "
                             "baseline: uniform (equal operator counts), parameters (equal "
                             "weights), time (equal compute, no communication)")
    search.add_argument("--time-limit", type=float, default=_SEARCH.time_limit_s,
                        help="ILP time limit in seconds")
    search.add_argument("--exact-budget", type=float, default=_SEARCH.exact_budget_s,
                        metavar="SECONDS",
                        help="with --solver dp: prove the cut optimal or better it by CP-SAT "
                             "within SECONDS of deterministic time (one worker: the same plan "
                             "at any load; graphs up to 600 operators; 0 = off)")
    _cluster_args(p)
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", required=True, type=Path, help="plan folder to write")
    out.add_argument("--force", action="store_true",
                     help="replace an output folder that is not an earlier plan")
    _json_arg(out)


def _cluster_args(p: argparse.ArgumentParser) -> None:
    """``partition``'s cluster options."""
    g = p.add_argument_group("cluster plans (stages x data-parallel replicas)")
    g.add_argument("--devices", "--nproc-per-node", type=int,
                   help="devices per machine (as torchrun's --nproc-per-node): plan replicas "
                        "per stage")
    g.add_argument("--machines", "--nnodes", type=int, default=ClusterFields.machines,
                   help="machines (as torchrun's --nnodes)")
    g.add_argument("--device-memory",
                   help="memory per device: 80GB, 16G, 16gb, 16GiB, 512MiB; a bare number is "
                        "GB (default: a named GPU's datasheet memory, else unlimited)")
    g.add_argument("--inter-bandwidth", type=float,
                   help="link bandwidth between machines in GB/s (default 1.25: 10 GbE)")
    g.add_argument("--inter-latency", type=float,
                   help="link latency between machines in ms (default 0.05)")
    g.add_argument("--cluster", type=Path,
                   help="cluster.json (overrides --devices, --machines and the link and "
                        "memory options)")


def _run_args(p: argparse.ArgumentParser, rank: bool = False) -> None:
    """``run``'s options; ``rank``: those of one torchrun rank of such a run (no --warmup,
    --nproc, --check, --json; --backend and --output-dir instead)."""
    p.add_argument("plan", type=Path, help="plan folder (from partition)")
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch (default: the plan's); an iteration feeds "
                        "batch size x micro-batches rows")
    p.add_argument("--microbatches", type=int,
                   help="micro-batches per iteration (default: the plan's, else 8)")
    p.add_argument("--iterations", type=int, default=10, help="timed iterations")
    if not rank:
        p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--threads-per-stage", type=int, default=1,
                   help="onnxruntime intra-op threads per stage replica")
    procs: argparse.ArgumentParser | argparse._ArgumentGroup = p if rank else \
        p.add_argument_group("processes (--nproc): one per stage replica, over "
                             "torch.distributed; rank 0 draws every rank's progress")
    if not rank:
        procs.add_argument("--nproc", type=int,
                       help="run one process per stage replica over torch.distributed (gloo on "
                            "CPU, NCCL on GPUs) instead of threads; must equal the plan's "
                            "replicas in total (torchrun's --nproc-per-node is per machine)")
    p.add_argument("--device", choices=("cpu",),
                   help="run every stage on this device instead of the plan's: cpu checks a "
                        "CUDA plan's numerics on a machine without a GPU")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="feed an input from a .npy file (repeatable); others are random")
    if not rank:
        p.add_argument("--check", action="store_true",
                       help="compare outputs with the whole model run in one session")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    procs.add_argument("--timeout", type=float, default=60.0,
                   help=f"{'' if rank else 'with --nproc: '}seconds a rank may block on one "
                        "operation or stay silent before the run fails naming it")
    if rank:
        _backend_arg(p)
        p.add_argument("--output-dir", type=Path, help="rank 0 saves the outputs here as .npy")
    else:
        _json_arg(p)


def _train_args(p: argparse.ArgumentParser, rank: bool = False) -> None:
    """``train``'s options; ``rank``: those of one torchrun rank of a training run (no --nproc,
    --save, --record, --engine; --backend instead)."""
    p.add_argument("plan", type=Path, help="a train-mode plan folder (partition --mode train)")
    p.add_argument("--steps", type=int, default=DEFAULTS.steps, help="optimizer steps")
    p.add_argument("--microbatches", type=int,
                   help=f"micro-batches per step (default: the plan's, else "
                        f"{DEFAULT_MICROBATCHES})")
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch (default: as partitioned); a step takes "
                        "batch-size x microbatches rows")
    p.add_argument("--schedule",
                   choices=[*schedules.TRAIN_NAMES, *([] if rank else TORCH_SCHEDULES)],
                   help="the pipeline schedule every rank executes (the simulator's; default: "
                        "the plan's, see plan.json's schedule, else 1f1b). "
                        + _schedule_help(schedules.TRAIN_NAMES)
                        + "; interleaved-zb: torch's ScheduleInterleavedZeroBubble, --engine "
                          "torch only, two stages per process")
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="optimizer (default: the one the plan's memory was priced for, "
                        "plan.json optimizer, else sgd)")
    p.add_argument("--lr", type=float, default=DEFAULTS.optimizer.lr, help="learning rate")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed,
                   help="seed of dropout and of the synthetic batches (without --data)")
    p.add_argument("--data", type=Path, metavar="FILE",
                   help="train on a .npz (or a folder of .npy, memory-mapped) with arrays named "
                        "as the model's inputs plus 'labels' (or one per output, named as it); "
                        "step k takes the next batch-size x microbatches rows in order; "
                        "without it, synthetic batches")
    p.add_argument("--shuffle", type=int, metavar="SEED",
                   help="permute --data's rows once per epoch, reproducibly from SEED")
    p.add_argument("--loss", default=DEFAULTS.data.loss, choices=LOSSES,
                   help="cross_entropy (first output vs labels, ignore -100), mse, output (the "
                        "model's first output is its loss), auto: output for a scalar output, "
                        "cross_entropy for integer labels, else mse")
    p.add_argument("--check", action="store_true",
                   help="dropout off; parameters after step 1 (and 3) must equal "
                        "single-process training (exit 1 otherwise)")
    _train_optim_args(p)
    from onnx_partition.cli.pretrained_args import pretrained_args

    pretrained_args(p, rank)
    if rank:
        _backend_arg(p)
        return
    p.add_argument("--nproc", type=int,
                   help="processes (default: one per stage replica of the plan); must equal "
                        "the plan's stage replicas in total")
    p.add_argument("--save", type=Path, metavar="OUT",
                   help="write the trained weights as a new plan folder that `run` serves")
    p.add_argument("--record", type=Path, metavar="FILE",
                   help="write the measured per-stage forward/backward ms (plan.json's "
                        "simulator_costs form) to FILE")
    p.add_argument("--engine", default=DEFAULTS.engine.name, choices=ENGINES,
                   help="ours (any plan); torch: torch.distributed.pipelining's "
                        "PipelineStage and Schedule1F1B/ScheduleGPipe on our stage modules "
                        "(plans with equal replicas per stage; see docs/design.md)")
    _json_arg(p)


def _train_optim_args(p: argparse.ArgumentParser) -> None:
    """``train``'s optimisation, checkpoint, evaluation and log options (issue 21, items 3-5)."""
    from onnx_partition.runtime.train.choices import PRECISIONS
    from onnx_partition.runtime.train.lr_schedule import LR_SCHEDULES

    p.add_argument("--weight-decay", type=float,
                   help=f"weight decay (default: torch.optim's, SGD {WEIGHT_DECAY['sgd']:g}, "
                        f"AdamW {WEIGHT_DECAY['adamw']:g})")
    optimizer = DEFAULTS.optimizer
    p.add_argument("--momentum", type=float, default=optimizer.momentum, help="SGD momentum")
    p.add_argument("--betas", type=float, nargs=2, default=optimizer.betas,
                   metavar=("B1", "B2"), help="AdamW betas")
    p.add_argument("--warmup-steps", type=int, default=optimizer.warmup_steps,
                   help="linear learning-rate warm-up from 0 over K steps")
    p.add_argument("--lr-schedule", default=optimizer.lr_schedule, choices=LR_SCHEDULES,
                   help="learning rate after the warm-up, over --steps in all (as "
                        "transformers' schedulers)")
    p.add_argument("--clip-grad-norm", type=float, metavar="X",
                   help="clip the whole model's gradient to norm X (as clip_grad_norm_)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="bf16: bfloat16 autocast with fp32 master weights (CPU too; default: "
                        "the plan's, plan.json precision, else fp32)")
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                   help="write checkpoints (every rank's parameters, optimizer and RNG state) "
                        "into DIR")
    p.add_argument("--checkpoint-every", type=int, default=DEFAULTS.checkpoint.every,
                   metavar="K",
                   help="checkpoint after every K steps (and after the last)")
    p.add_argument("--resume", type=Path, metavar="DIR",
                   help="continue from DIR's latest complete checkpoint up to --steps in all, "
                        "checkpointing on into DIR")
    p.add_argument("--max-restarts", type=int, default=DEFAULTS.checkpoint.max_restarts,
                   metavar="N", help="when a rank is lost, restart every rank from the newest "
                   "complete checkpoint in --checkpoint-dir, up to N times")
    p.add_argument("--eval-every", type=int, default=DEFAULTS.data.eval_every, metavar="K",
                   help="print a validation loss after every K steps (and after the last)")
    p.add_argument("--eval-data", type=Path, metavar="FILE",
                   help="validation data (default: synthetic batches of another seed)")
    p.add_argument("--log", "--log-file", dest="log", type=Path, metavar="FILE",
                   help="append one JSON object per step (step, time, loss, lr, grad_norm, "
                        "samples_per_s, tokens_per_s); under torchrun spell it --log-file "
                        "(torchrun's parser takes --log for its --log-dir)")


def _backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("gloo", "nccl"),
                   help="run: default gloo (nccl only when asked: its GPU path is unconfirmed); "
                        "train: default nccl when every rank has its own GPU, else gloo")


def _simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", type=Path, help="plan folder (from partition)")
    _schedule_args(p)
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch for samples/s (default: the plan's; another "
                        "size scales the times linearly)")
    _json_arg(p)


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", type=Path, help="plan folder (from partition)")
    p.add_argument("-o", "--output", type=Path,
                   help="HTML file to write (default: PLAN.report.html beside the folder)")
    p.add_argument("--measured", type=Path, metavar="RUN.json",
                   help="a `run --json` file: show the measured run next to the simulation")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing file that is not an earlier report")
    _schedule_args(p)


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt",
                   help="recipe: resnet, inception, unet, gpt, bert, encdec")
    p.add_argument("--size", default="tiny", help="tiny | small | realistic")
    p.add_argument("--stages", type=int,
                   help="pipeline stages (default: one per CPU this process may run on, at "
                        "most 4)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="rows per micro-batch to partition and run (32: the tiny GPT's stages "
                        "then take about a millisecond, which times steadier than less)")
    p.add_argument("--workdir", type=Path, help="keep files here (default: a temporary folder)")


_VERBS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("export", "export a model recipe from models/, or a Hugging Face config, to ONNX",
     export_args),
    ("profile", "measure every node's time on a device -> costs.json", _profile_args),
    ("partition", "cut a model into stage files and plan.json", _partition_args),
    ("run", "run a plan folder as a pipeline and measure it", _run_args),
    ("train", "train a train-mode plan: one process per stage replica", _train_args),
    ("simulate", "simulate a plan's schedule: time, bubbles, memory", _simulate_args),
    ("report", "write a self-contained HTML report of a plan", _report_args),
    ("demo", "export a recipe, price it here, partition, run and check it", _demo_args),
)


def plan_defaults(args: argparse.Namespace, recorded: Mapping[str, Any]) -> str | None:
    """Fill ``train``'s --optimizer, --precision and --schedule not given with what the plan
    was priced for (plan.json ``optimizer``, ``precision``, ``schedule``: ``recorded``, the
    plan's extra keys), else :data:`TRAIN_FALLBACKS`; returns one warning line when an option
    asks for something else than the plan assumed (its time and memory figures do not hold).
    The rule is :func:`~onnx_partition.request.train.planned_choices`, which
    ``train_plan`` follows too."""
    chosen, warning = planned_choices(
        recorded, {k: getattr(args, k, None) for k in TRAIN_FALLBACKS},
        engine=getattr(args, "engine", None))
    for key, value in chosen.items():
        setattr(args, key, value)
    return warning


def train_options(args: argparse.Namespace, *, rank: bool = False) -> dict[str, Any]:
    """Every ``train_plan`` keyword that ``train``'s options give (``rank``: those of a
    torchrun rank, :func:`rank_parser`), the one reader of both parsers
    (:func:`onnx_partition.request.train.train_job` makes the job of them): each option's
    ``dest`` is its keyword (:data:`~onnx_partition.request.train.KEYWORDS`; ``-v``, the
    command's verbosity, is not ``verbose``); --optimizer, --precision and --schedule as
    :func:`plan_defaults` filled them (else :data:`TRAIN_FALLBACKS`). Rank 0 prints a line per
    step unless --json, and the local verb a progress bar too (a torchrun rank's output goes
    through the launcher)."""
    for key, fallback in TRAIN_FALLBACKS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, fallback)
    given = {key: value for key, value in vars(args).items()
             if key in KEYWORDS and key != "verbose"}
    given["betas"] = tuple(args.betas)
    quiet = bool(given.get("json", False))
    return {**given, "verbose": not quiet, "progress": not quiet and not rank}
