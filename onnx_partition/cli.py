"""The ``onnx-partition`` command: export, partition, run, demo.

Bad input prints ``error: <one line>`` and exits with code 2; a run whose outputs differ from the
whole model's exits with code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onnx_partition import __version__, values
from onnx_partition.cost.cluster import Cluster, Link, load_cluster, parse_bytes
from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan, read_plan

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
log = logging.getLogger("onnx_partition")
MISSING_ORT = ("onnxruntime is not installed: pip install 'onnx-partition[cpu]', or "
               "'onnx-partition[gpu]' for onnxruntime-gpu (install one, not both)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    values.install(parser)  # every numeric option checked: finite, in range, unit in the message
    return guarded(lambda: _dispatch(parser.parse_args(argv)))


def _dispatch(args: argparse.Namespace) -> int:
    _configure_logging(args.verbose - args.quiet)
    from onnx_partition import progress

    progress.install(log.isEnabledFor(logging.INFO))
    log.debug("onnx-partition %s, python %s, arguments %s", __version__,
              sys.version.split()[0], {k: v for k, v in vars(args).items() if k != "func"})
    began = time.perf_counter()
    code = int(args.func(args))
    log.debug("%s finished in %.2f s with exit code %d", args.verb,
              time.perf_counter() - began, code)
    return code


def guarded(command: Callable[[], int]) -> int:
    """Run a command (argument parsing included) and return its exit code: bad input prints
    ``error: <one line>`` and gives 2, a failed run (a stage raised, a worker died) 1, an
    interrupt 130, a closed stdout pipe 0; never a traceback for any of them."""
    from onnx_partition.errors import StageFailed

    try:
        return command()
    except BrokenPipeError:  # `onnx-partition ... | head`: the reader has all it wanted
        _silence_stdout()
        return 0
    except PartitionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StageFailed as exc:  # a stage raised or a worker died while running
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if exc.name != "onnxruntime":
            raise
        print(f"error: {MISSING_ORT}", file=sys.stderr)
        return EXIT_BAD_INPUT


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except the uninformative ones (None, False, [])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _StdoutHandler(logging.Handler):
    """Messages to the current ``sys.stdout`` (looked up per message, so redirection and
    pytest's capture see them)."""

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        if record.levelno != logging.INFO:  # debug: ..., warning: ...
            text = f"{record.levelname.lower()}: {text}"
        print(text, file=sys.stdout if record.levelno < logging.WARNING else sys.stderr,
              flush=True)


def _configure_logging(verbosity: int) -> None:
    """-q: warnings and errors only; default: progress lines; -v: debug lines too."""
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    if not any(isinstance(h, _StdoutHandler) for h in log.handlers):
        log.addHandler(_StdoutHandler())
        log.propagate = False
    log.setLevel(level)


def _silence_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush does not
    raise again (the recipe in Python's signal module documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured)
        pass


def _say(text: str) -> None:
    """A progress or status line (hidden by -q)."""
    log.info(text)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _verbosity_args(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("-q", "--quiet", action="count", default=default,
                   help="print only results, warnings and errors (no progress lines or bars)")
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="also print debug lines")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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

    p = verbs.add_parser("export", help="export a model recipe from models/ to ONNX")
    p.add_argument("name", help="recipe: resnet, inception, unet, gpt, bert, encdec")
    p.add_argument("--size", default="tiny", help="tiny | small | realistic")
    p.add_argument("--batch-size", type=int, default=2, help="example batch used for tracing")
    p.add_argument("-o", "--output", required=True, type=Path, help="ONNX file to write")
    p.set_defaults(func=_export)

    p = verbs.add_parser("profile", help="measure every node's time on a device -> costs.json")
    p.add_argument("model", type=Path, help="the ONNX model to measure")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    _shape_args(p)
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median taken)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    p.add_argument("-o", "--output", required=True, type=Path, help="costs.json to write")
    p.set_defaults(func=_profile)

    p = verbs.add_parser("partition", help="cut a model into stage files and plan.json")
    p.add_argument("model", type=Path, help="the ONNX model to cut")
    p.add_argument("--stages", "-s", type=int,
                   help="number of pipeline stages (with a cluster: fix the depth, else chosen)")
    p.add_argument("-o", "--output", required=True, type=Path, help="plan folder to write")
    p.add_argument("--costs", type=Path, help="costs.json (contract format); else analytic")
    _shape_args(p)
    p.add_argument("--bandwidth", type=float, default=10.0,
                   help="link bandwidth between stages in GB/s, and between the devices of a "
                        "machine with --devices (0 = free)")
    p.add_argument("--latency", type=float, default=0.02, help="link latency in ms")
    p.add_argument("--order", default="auto", choices=("auto", "topo", "dfs", "minlive", "cluster"),
                   help="how to sequence the DAG before the DP (auto: try all, keep the best)")
    p.add_argument("--solver", default="dp", choices=("dp", "ilp", "uniform", "parameters", "time"),
                   help="dp, ilp (exact OR-Tools CP-SAT over the DAG, seeded by dp), "
                        "or a baseline: uniform (equal operator counts), parameters (equal "
                        "weights), time (equal compute, no communication)")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds")
    g = p.add_argument_group("hybrid parallelism (stages x data-parallel replicas)")
    g.add_argument("--devices", "--nproc-per-node", type=int,
                   help="devices per machine (as torchrun's --nproc-per-node): plan replicas "
                        "per stage")
    g.add_argument("--machines", "--nnodes", type=int, default=1,
                   help="machines (as torchrun's --nnodes)")
    g.add_argument("--device-memory",
                   help="memory per device: 80GB, 16G, 16gb, 16GiB, 512MiB; a bare number is "
                        "GB (default: unlimited)")
    g.add_argument("--device-kind", default="cpu", choices=("cpu", "cuda"),
                   help="the devices the plan is for (cuda: stage files placed on cuda:N)")
    g.add_argument("--gpu", help="GPU of the analytic costs: v100, a100-40gb, a100-80gb, h100 "
                   "(default), h200, l4; NAME:fp32|tf32|bf16|fp16 sets the math of fp32 graphs")
    g.add_argument("--strict-costs", action="store_true",
                   help="refuse a costs file measured on another device kind than the cluster's")
    g.add_argument("--inter-bandwidth", type=float,
                   help="link bandwidth between machines in GB/s (default 1.25: 10 GbE)")
    g.add_argument("--inter-latency", type=float,
                   help="link latency between machines in ms (default 0.05)")
    g.add_argument("--cluster", type=Path, help="cluster.json (overrides the options above)")
    g.add_argument("--mode", default="infer", choices=("infer", "train"),
                   help="infer: forward only; train: forward, backward, all-reduce, 1F1B memory")
    g.add_argument("--microbatches", type=int, default=8, help="micro-batches per iteration")
    p.add_argument("--force", action="store_true",
                   help="replace an output folder that is not an earlier plan")
    _json_arg(p)
    p.set_defaults(func=_partition)

    p = verbs.add_parser("run", help="run a plan folder as a pipeline and measure it")
    p.add_argument("plan", type=Path, help="plan folder (from partition)")
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch (default: the plan's); an iteration feeds "
                        "batch size x micro-batches rows")
    p.add_argument("--microbatches", type=int,
                   help="micro-batches per iteration (default: the plan's, else 8)")
    p.add_argument("--iterations", type=int, default=10, help="timed iterations")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--threads-per-stage", type=int, default=1,
                   help="onnxruntime intra-op threads per stage replica")
    p.add_argument("--nproc", type=int,
                   help="run one process per stage replica over torch.distributed (gloo on "
                        "CPU, NCCL on GPUs) instead of threads; must equal the plan's replicas "
                        "in total (torchrun's --nproc-per-node is per machine)")
    p.add_argument("--device", choices=("cpu",),
                   help="run every stage on this device instead of the plan's: cpu checks a "
                        "CUDA plan's numerics on a machine without a GPU")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="feed an input from a .npy file (repeatable); others are random")
    p.add_argument("--check", action="store_true",
                   help="compare outputs with the whole model run in one session")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="with --nproc: seconds a rank may block on one operation or stay "
                        "silent before the run fails naming it")
    _json_arg(p)
    p.set_defaults(func=_run)

    p = verbs.add_parser("train", help="train a train-mode plan: one process per stage replica")
    _train_args(p)
    p.set_defaults(func=_train)

    p = verbs.add_parser("simulate", help="simulate a plan's schedule: time, bubbles, memory")
    p.add_argument("plan", type=Path, help="plan folder (from partition)")
    _schedule_args(p)
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch for samples/s (default: the plan's; another "
                        "size scales the times linearly)")
    _json_arg(p)
    p.set_defaults(func=_simulate)

    p = verbs.add_parser("report", help="write a self-contained HTML report of a plan")
    p.add_argument("plan", type=Path, help="plan folder (from partition)")
    p.add_argument("-o", "--output", type=Path,
                   help="HTML file to write (default: PLAN.report.html beside the folder)")
    p.add_argument("--measured", type=Path, metavar="RUN.json",
                   help="a `run --json` file: show the measured run next to the simulation")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing file that is not an earlier report")
    _schedule_args(p)
    p.set_defaults(func=_report)

    p = verbs.add_parser("demo", help="export a recipe, partition it, run it, check it")
    p.add_argument("--model", default="gpt", help="recipe name (default gpt)")
    p.add_argument("--size", default="tiny", help="tiny | small | realistic")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages")
    p.add_argument("--batch-size", type=int, default=8, help="batch to partition and run")
    p.add_argument("--workdir", type=Path, help="keep files here (default: a temporary folder)")
    p.set_defaults(func=_demo)
    return parser


def _verb_parser(common: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    """Verb parsers that show defaults and take -q/-v after the verb too."""

    class VerbParser(argparse.ArgumentParser):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.setdefault("formatter_class", _Help)
            kwargs.setdefault("parents", [common])
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    return VerbParser


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "infer"),
                   help="default: 1f1b for training plans, infer otherwise; interleaved: "
                        "interleaved 1F1B, the stages as --chunks model chunks per device")
    p.add_argument("--microbatches", type=int, help="micro-batches (default: the plan's)")
    p.add_argument("--no-verify", action="store_true",
                   help="check the plan folder's file sizes only, not their sha256")
    p.add_argument("--chunks", type=int,
                   help="model chunks per device for --schedule interleaved (default 2); "
                        "must divide the stage count")


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout instead of text (plan.json's field "
                        "names)")


def _chunks(args: argparse.Namespace) -> int | None:
    """``--chunks``, which only the interleaved schedule takes."""
    if args.chunks is not None and args.schedule != "interleaved":
        raise PartitionError("--chunks needs --schedule interleaved")
    return args.chunks


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an input's shape (repeatable)")
    p.add_argument("--batch-size", type=int,
                   help="rows per micro-batch: fixes a symbolic leading (batch) dim")


def parse_input_shapes(items: Sequence[str]) -> dict[str, list[int]]:
    """``NAME=2,3,224`` items -> {NAME: [2, 3, 224]}; a clear error otherwise."""
    return dict(values.input_shape(item) for item in items)


# --------------------------------------------------------------------------- verbs


def _export(args: argparse.Namespace) -> int:
    import models

    try:
        started = time.perf_counter()
        path = models.export(args.name, args.output, size=args.size, batch_size=args.batch_size)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    _say(f"wrote {path} and its program {path.with_suffix('.pt2').name} ({args.name}, "
         f"{args.size}) in {time.perf_counter() - started:.1f} s")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from onnx_partition.cost.profile import profile_to_file

    if args.repeats < 1 or args.threads < 1:
        raise PartitionError("--repeats and --threads must be at least 1")
    started = time.perf_counter()
    result = profile_to_file(
        args.model, args.output, device=args.device, batch_size=args.batch_size,
        input_shapes=parse_input_shapes(args.input_shape), repeats=args.repeats,
        threads=args.threads, progress=_progress_bar("profiling"),
    )
    _say(f"wrote {args.output}: {len(result.forward_ms)} nodes on {result.device}, "
          f"whole model {result.whole_model_ms:.3f} ms (per-node sum before calibration "
          f"{result.raw_sum_ms:.3f} ms), {result.unique_signatures} distinct operators measured, "
          f"{result.reused} reused, in {time.perf_counter() - started:.1f} s")
    return 0


def _progress_bar(label: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing a tqdm bar with its ETA on stderr, only
    when stderr is a terminal and -q is not given."""
    from onnx_partition.progress import progress_callback

    return progress_callback(label, enabled=log.isEnabledFor(logging.INFO))


def _partition(args: argparse.Namespace) -> int:
    from onnx_partition.cost.devices import device_for
    from onnx_partition.partition import partition, priced_by
    from onnx_partition.report import batch_line, plan_table

    if args.stages is not None and args.stages < 1:
        raise PartitionError(f"--stages must be at least 1, got {args.stages}")
    if args.microbatches < 1:
        raise PartitionError(f"--microbatches must be at least 1, got {args.microbatches}")
    stop_bar = _ilp_bar(args)
    cluster = _cluster(args)
    plan = partition(
        args.model,
        args.stages,
        args.output,
        costs=args.costs,
        device=None if cluster or args.costs else device_for(args.device_kind, args.gpu),
        strict_costs=args.strict_costs,
        input_shapes=parse_input_shapes(args.input_shape),
        batch_size=args.batch_size,
        link=Link(args.bandwidth, args.latency),
        cluster=cluster,
        mode=args.mode,
        microbatches=args.microbatches,
        ordering=args.order,
        solver=args.solver,
        time_limit_s=args.time_limit,
        force=args.force,
    )
    stop_bar()
    costs_check = plan.costs.get("check", {})
    for note in costs_check.get("notes", []):
        print(note, file=sys.stderr)
    if args.json:
        from onnx_partition.measured import dumps, partition_json

        print(dumps(partition_json(plan, args.output)))
        return 0
    print(plan_table(plan))
    print(batch_line(plan, args.batch_size))
    print(priced_by(plan))
    warning = (plan.device_model or {}).get("warning")
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    _say(f"wrote {_plural(len(plan.stages), 'stage')} and plan.json to {args.output} "
         f"in {plan.partition_s or 0:.2f} s")
    return 0


def _ilp_bar(args: argparse.Namespace) -> Callable[[], None]:
    """A bar over the ILP's time limit (its ETA) while partition runs; returns its stop."""
    from onnx_partition.progress import timed

    limit = args.time_limit if args.solver == "ilp" else 0.0
    bar = timed("ILP (CP-SAT)", limit, enabled=bool(limit) and log.isEnabledFor(logging.INFO))
    bar.__enter__()

    def stop() -> None:
        bar.__exit__(None, None, None)

    return stop


def _cluster(args: argparse.Namespace) -> Cluster | None:
    """The cluster the options describe, or None for a plain pipeline of --stages devices."""
    if args.cluster is not None:
        cluster = load_cluster(args.cluster)
        return dataclasses.replace(cluster, gpu=args.gpu) if args.gpu else cluster
    if args.gpu and args.device_kind != "cuda":
        raise PartitionError("--gpu needs --device-kind cuda")
    inter = args.inter_bandwidth is not None or args.inter_latency is not None
    if args.devices is None:
        if args.device_memory or inter:  # (--mode train alone: a plain train-mode pipeline)
            raise PartitionError("--device-memory and --inter-bandwidth/latency "
                                 "need --devices N or --cluster")
        return None
    if args.devices < 1 or args.machines < 1:
        raise PartitionError("--devices and --machines must be at least 1")
    for name, value in (("--bandwidth", args.bandwidth), ("--latency", args.latency),
                        ("--inter-bandwidth", args.inter_bandwidth),
                        ("--inter-latency", args.inter_latency)):
        if value is not None and not value >= 0:
            raise PartitionError(f"{name} must be >= 0, got {value}")
    memory = parse_bytes(args.device_memory) / 1e9 if args.device_memory else float("inf")
    if args.device_memory:
        _say(f"device memory {args.device_memory!r} read as {values.fmt_bytes(memory * 1e9)} "
             f"({memory * 1e9:,.0f} bytes) per device")
    default = Cluster()
    return Cluster(machines=args.machines, devices_per_machine=args.devices, memory_gb=memory,
                   kind=args.device_kind, gpu=args.gpu,
                   intra=Link(args.bandwidth, args.latency),
                   inter=Link(
                       default.inter.bandwidth_gbps if args.inter_bandwidth is None
                       else args.inter_bandwidth,
                       default.inter.latency_ms if args.inter_latency is None
                       else args.inter_latency))


def _run(args: argparse.Namespace) -> int:
    """Run the plan as planned: its micro-batch size and count unless told, every replica fed
    (replica j of r takes micro-batches m = j mod r), then measured against predicted."""
    from onnx_partition.measured import (
        dumps,
        format_comparison,
        idle_replicas_note,
        plan_batch_size,
        plan_microbatches,
        run_json,
        run_shape,
    )
    from onnx_partition.runtime.measure import measure_distributed, measure_threads, shape_of_feeds
    from onnx_partition.runtime.microbatch import batch_axes

    plan = read_plan(args.plan)
    shape = run_shape(plan, batch_size=args.batch_size, microbatches=args.microbatches)
    feeds = run_feeds(plan, args.input, rows=shape.rows, seed=args.seed)
    shape = shape_of_feeds(shape, feeds, batch_axes(plan))
    if args.iterations < 1 or args.warmup < 0:
        raise PartitionError("--iterations must be at least 1 and --warmup at least 0")
    out = sys.stderr if args.json else sys.stdout
    note = idle_replicas_note(plan, shape.microbatches)
    if note:
        print(note, file=sys.stderr)
    planned = (plan_batch_size(plan), plan_microbatches(plan))
    default = "" if "microbatches" in plan.predicted else " by default"
    print(f"{_plural(len(plan.stages), 'stage')} "
          f"({' + '.join(str(s.replicas) for s in plan.stages)} "
          f"replicas), {shape.microbatches} micro-batches x {shape.batch_size} rows = "
          f"{shape.rows} rows per iteration (plan: {planned[1]} micro-batches{default} x "
          f"{planned[0] or '?'} rows)", file=out)
    options = {"warmup": args.warmup, "iterations": args.iterations,
               "threads_per_stage": args.threads_per_stage}
    if args.nproc is not None:
        runtime, measured, outputs = measure_distributed(
            args.plan, plan, feeds, shape, nproc=args.nproc, device=args.device,
            timeout_s=args.timeout, **options)
    else:
        runtime, measured, outputs = measure_threads(
            args.plan, plan, feeds, shape, providers=_providers(args),
            show_progress=not args.json and log.isEnabledFor(logging.INFO), **options)
    body = run_json(plan, shape, runtime, measured, warmup=args.warmup)
    code = _check(args.plan, plan, feeds, outputs, out) if args.check else 0
    if args.check:
        body["check"] = "ok" if code == 0 else "mismatch"
    if args.json:
        print(dumps(body))
    else:
        print(format_comparison(body))
        print(timing_line(measured["iteration_ms_each"]))
    return code


def run_feeds(plan: Plan, inputs: Sequence[str], *, rows: int, seed: int) -> dict[str, np.ndarray]:
    """The feeds of ``run`` (and of a torchrun rank 0): seeded random inputs of ``rows`` rows,
    each ``NAME=FILE.npy`` of ``inputs`` (``--input``) read from its file instead."""
    from onnx_partition.runtime.check import random_feeds

    feeds = random_feeds(plan, batch_size=rows, seed=seed)
    for item in inputs:
        name, sep, file = item.partition("=")
        if not sep or name not in feeds:
            raise PartitionError(f"--input {item!r}: expected NAME=FILE.npy with NAME one of "
                                 f"{', '.join(feeds)}")
        try:
            feeds[name] = np.load(file)
        except (OSError, ValueError) as exc:
            raise PartitionError(f"--input {item!r}: cannot read {file}: {exc}") from None
    return feeds


def _providers(args: argparse.Namespace) -> list[str] | None:
    """``--device cpu``: every stage on onnxruntime's CPU provider, whatever the plan says."""
    return ["CPUExecutionProvider"] if args.device == "cpu" else None


def timing_line(samples_ms: Sequence[float]) -> str:
    """Per-iteration latency as onnxruntime_perf_test reports it: mean, P50, P90, P99 (numpy's
    linear percentiles) over the timed iterations."""
    times = np.asarray(samples_ms, dtype=np.float64)
    if times.size == 0:
        return "latency: no timed iterations"
    p50, p90, p99 = np.percentile(times, [50, 90, 99])
    return (f"latency per iteration over {_plural(times.size, 'iteration')}: mean "
            f"{times.mean():.2f} ms, P50 {p50:.2f} ms, P90 {p90:.2f} ms, P99 {p99:.2f} ms")


def _check(
    plan_dir: Path, plan: Plan, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
    out: Any = None,
) -> int:
    """Compare pipelined outputs with the whole model's; exit code 1 on a mismatch."""
    from onnx_partition.runtime.check import compare, whole_model_outputs

    worst = compare(outputs, whole_model_outputs(plan_dir, plan, feeds))
    verdict = "OK" if worst <= 1e-5 else "MISMATCH"
    print(f"check against the whole model: max relative error {worst:.2e} ({verdict})",
          file=out or sys.stdout)
    return 0 if verdict == "OK" else 1


def _train_args(p: argparse.ArgumentParser) -> None:
    from onnx_partition.train.runtime import ENGINES, add_train_args

    add_train_args(p)
    p.add_argument("--nproc", type=int, help="processes; must equal the plan's stage replicas")
    p.add_argument("--save", type=Path, metavar="OUT",
                   help="write the trained weights as a new plan folder that `run` serves")
    p.add_argument("--record", type=Path, metavar="FILE",
                   help="write the measured per-stage forward/backward ms (plan.json's "
                        "simulator_costs form) to FILE")
    p.add_argument("--engine", default="ours", choices=ENGINES,
                   help="ours (any plan); torch (torch.distributed.pipelining) is refused "
                        "for now, see docs/design.md")


def _train(args: argparse.Namespace) -> int:
    from onnx_partition.train.runtime import format_train, train_plan

    stats = train_plan(args.plan, nproc=args.nproc, steps=args.steps,
                       microbatches=args.microbatches, batch_size=args.batch_size,
                       schedule=args.schedule, optimizer=args.optimizer, lr=args.lr,
                       check=args.check, save=args.save, record=args.record,
                       engine=args.engine, seed=args.seed,
                       verbose=True)
    print(format_train(stats))
    return EXIT_FAILED if stats.mismatches else 0


def _simulate(args: argparse.Namespace) -> int:
    from onnx_partition.measured import dumps, simulate_json
    from onnx_partition.plan_sim import format_simulation, simulate_plan
    from onnx_partition.plandir import verify

    plan = read_plan(args.plan)
    verify(args.plan, plan, hashes=not args.no_verify)
    result, _ = simulate_plan(plan, schedule=args.schedule, microbatches=args.microbatches,
                              chunks=_chunks(args))
    body = simulate_json(plan, result, schedule=args.schedule, microbatches=args.microbatches,
                         batch_size=args.batch_size)
    if args.json:
        print(dumps(body))
        return 0
    print(format_simulation(plan, result))
    if body["samples_per_s"]:
        scaled = (f", times scaled linearly from the plan's {body['scaled_from_batch_size']}"
                  if body.get("scaled_from_batch_size") else "")
        print(f"{body['samples_per_s']:.1f} samples/s ({body['microbatches']} micro-batches x "
              f"{body['batch_size']} rows per iteration of {body['iteration_ms']:.3f} ms"
              f"{scaled})")
    return 0


def _report(args: argparse.Namespace) -> int:
    from onnx_partition.report import write_report

    path = write_report(args.plan, args.output, schedule=args.schedule,
                        microbatches=args.microbatches, chunks=_chunks(args),
                        measured=args.measured, force=args.force,
                        hashes=not args.no_verify)
    _say(f"wrote {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="onnx-partition-demo-") as tmp:
            return _demo_in(args, Path(tmp))
    args.workdir.mkdir(parents=True, exist_ok=True)
    return _demo_in(args, args.workdir)


def _demo_in(args: argparse.Namespace, work: Path) -> int:
    model = work / f"{args.model}.onnx"
    plan = work / "plan"
    steps = [
        ["export", args.model, "--size", args.size, "-o", str(model)],
        ["partition", str(model), "--stages", str(args.stages), "--batch-size",
         str(args.batch_size), "-o", str(plan)],
        ["run", str(plan), "--check"],  # the plan's micro-batch size and count
    ]
    for step in steps:
        _say(f"$ onnx-partition {' '.join(step)}")
        code = main(["-q"] * args.quiet + ["-v"] * args.verbose + step)  # keep -q/-v
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
