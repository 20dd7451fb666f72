"""The ``onnx-partition`` command: export, profile, partition, run, train, simulate, report,
demo. Each verb's function is here; their options are in :mod:`onnx_partition.cli.args`. A verb
imports what it runs when it runs (torch, onnxruntime, OR-Tools, numpy), so ``--version``,
``--help`` and the verbs that need none of them start quickly (``tests/test_imports.py``).

Bad input prints ``error: <one line>`` and exits with code 2; a run whose outputs differ from the
whole model's exits with code 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_partition import __version__, values
from onnx_partition.cli.args import (
    build_parser,
    chunks_of,
    input_shapes_of,
    plan_defaults,
    train_options,
)
from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan, read_plan

if TYPE_CHECKING:
    import numpy as np

    from onnx_partition.progress import Reporter
    from onnx_partition.request.partition import PartitionOptions

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "MISSING_ORT", "guarded", "main",
           "partition_options"]

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
    _configure_logging(args.verbose - args.quiet, bool(getattr(args, "json", False)))
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


class _StdoutHandler(logging.Handler):
    """Messages to the current ``sys.stdout`` (looked up per message, so redirection and
    pytest's capture see them); all to ``sys.stderr`` while ``quiet_stdout`` (``--json``:
    stdout holds the one JSON object)."""

    quiet_stdout = False

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        if record.levelno != logging.INFO:  # debug: ..., warning: ...
            text = f"{record.levelname.lower()}: {text}"
        to_stdout = record.levelno < logging.WARNING and not self.quiet_stdout
        print(text, file=sys.stdout if to_stdout else sys.stderr, flush=True)


def _configure_logging(verbosity: int, json_out: bool = False) -> None:
    """-q: warnings and errors only; default: progress lines; -v: debug lines too; with
    ``json_out`` (``--json``) every line goes to stderr."""
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    handler = next((h for h in log.handlers if isinstance(h, _StdoutHandler)), None)
    if handler is None:
        handler = _StdoutHandler()
        log.addHandler(handler)
        log.propagate = False
    handler.quiet_stdout = json_out
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


def _parser() -> argparse.ArgumentParser:
    """The command line (:mod:`onnx_partition.cli.args`), each verb bound to its function."""
    return build_parser({"export": _export, "profile": _profile, "partition": _partition,
                         "run": _run, "train": _train, "simulate": _simulate,
                         "report": _report, "demo": _demo})


# --------------------------------------------------------------------------- verbs


def _export(args: argparse.Namespace) -> int:
    if (args.name is None) == (args.hf_config is None):
        raise PartitionError("export takes exactly one of a recipe NAME or --hf-config DIR")
    if args.hf_config is not None:
        return _export_hf(args)
    hf_only = [flag for flag, given in (("--no-weights", args.no_weights),
                                        ("--hf-class", args.hf_class is not None)) if given]
    if hf_only:
        raise PartitionError(f"{hf_only[0]} goes with --hf-config, not a recipe")
    from onnx_partition import models

    try:
        started = time.perf_counter()
        path = models.export(args.name, args.output, size=args.size, batch_size=args.batch_size,
                             reporter=_bars())
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    _say(f"wrote {path} and its program {path.with_suffix('.pt2').name} ({args.name}, "
         f"{args.size}) in {time.perf_counter() - started:.1f} s")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from onnx_partition.models.hf import export_hf_config

    started = time.perf_counter()
    path = export_hf_config(args.hf_config, args.output, weights=not args.no_weights,
                            seq_len=args.seq_len, batch_size=args.batch_size,
                            class_name=args.hf_class, reporter=_bars())
    what = "no weights" if args.no_weights else "random weights"
    _say(f"wrote {path} and its program {path.with_suffix('.pt2').name} ({args.hf_config}, "
         f"{what}, sequence {args.seq_len}) in {time.perf_counter() - started:.1f} s")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from onnx_partition.cost.profile import profile_to_file

    if args.repeats < 1 or args.threads < 1:
        raise PartitionError("--repeats and --threads must be at least 1")
    started = time.perf_counter()
    if args.plan is not None:
        return _profile_plan(args, started)
    if args.model is None or args.output is None:
        raise PartitionError("profile needs MODEL and -o COSTS (or --plan PLAN)")
    _refuse_weightless(args.model)
    if args.precision != "fp32" and getattr(args, "mode", "infer") != "train":
        raise PartitionError(f"--precision {args.precision} measures training under autocast: "
                             "it needs --mode train")
    if getattr(args, "mode", "infer") == "train":
        from onnx_partition.cost.profile.torch_ops import profile_train_to_file
        from onnx_partition.fileio import sha256_file
        from onnx_partition.graph.export import program_path

        program = program_path(args.model)
        if program.is_file():  # a program is code: say which one runs, before it loads
            _say(f"program {program} sha256 {sha256_file(program)} (code: profile only "
                 "models you trust)")
        from onnx_partition.runtime.train.passes import split_call_ms
        from onnx_partition.runtime.train.probe import probe_engine

        trained = profile_train_to_file(
            args.model, args.output, device=args.device, batch_size=args.batch_size,
            input_shapes=input_shapes_of(args), repeats=args.repeats, threads=args.threads,
            progress=_progress_bar("profiling"), precision=args.precision,
            split=lambda: split_call_ms(device=args.device), probe=probe_engine)
        _say(f"wrote {args.output}: {len(trained.forward_ms)} nodes on {trained.device} "
             f"({trained.executor}), whole program forward {trained.whole_forward_ms:.3f} ms + "
             f"backward {trained.whole_backward_ms:.3f} ms, {trained.unique_signatures} "
             f"distinct ops measured, {trained.reused} reused, in "
             f"{time.perf_counter() - started:.1f} s")
        return 0
    result = profile_to_file(
        args.model, args.output, device=args.device, batch_size=args.batch_size,
        input_shapes=input_shapes_of(args), repeats=args.repeats,
        threads=args.threads, progress=_progress_bar("profiling"),
    )
    _say(f"wrote {args.output}: {len(result.forward_ms)} nodes on {result.device}, "
          f"whole model {result.whole_model_ms:.3f} ms (per-node sum before calibration "
          f"{result.raw_sum_ms:.3f} ms), {result.unique_signatures} distinct operators measured, "
          f"{result.reused} reused, in {time.perf_counter() - started:.1f} s")
    return 0


def _refuse_weightless(model: Path) -> None:
    """A weightless model cannot be timed: one line saying how to price it."""
    import onnx

    from onnx_partition.graph.weightless import model_weights

    try:
        weights = model_weights(onnx.load(str(model), load_external_data=False))
    except Exception:  # not a model: the profiler says so
        return
    if weights == "none":
        raise PartitionError(f"{model} has no weights (exported with --no-weights): profile "
                             "measures a model with weights; partition prices this one "
                             "analytically (--gpu NAME), or export it with weights to time it")


def _profile_plan(args: argparse.Namespace, started: float) -> int:
    from onnx_partition.calibrate.recut import calibrate_plan

    if args.model is not None:
        raise PartitionError("profile --plan PLAN takes no MODEL (the plan names its model)")
    if args.device != "cpu" or args.mode != "infer" or args.batch_size or args.input_shape:
        raise PartitionError("profile --plan times the stages on the plan's own devices, mode "
                             "and shapes: drop --device, --mode, --batch-size and --input-shape")
    plan = read_plan(args.plan)
    if plan.weights == "none":
        raise PartitionError(f"plan {args.plan} has no weights (exported with --no-weights): "
                             "profile --plan times its stages, which needs their weights")
    if plan.mode == "train" and plan.program:  # the engine's run loads it: say which one
        _say(f"program {Path(args.plan) / plan.program} sha256 {plan.program_sha256} "
             "(code: profile only plans you trust)")
    done = calibrate_plan(args.plan, out=args.output, rounds=args.rounds,
                          threads_per_stage=args.threads, repeats=args.repeats)
    for i, r in enumerate(done.rounds):
        ms = lambda values: " / ".join(f"{v:.3f}" for v in values)  # noqa: E731
        beside = (f"side by side {ms(r['side_by_side_ms'])} ms, in the pipeline "
                  f"{ms(r['pipeline_busy_ms'])} + {r['hop_ms']:.3f} ms per hop"
                  if "side_by_side_ms" in r else f"side by side {ms(r['together_ms'])} ms")
        _say(f"round {i + 1}: stages of {'/'.join(map(str, r['stages']))} nodes: priced "
             f"{ms(r['priced_ms'])} ms, alone {ms(r['alone_ms'])} ms, {beside}; re-cut: "
             f"{r['resolved']}")
    run = done.plan.calibrated.engine_run if done.plan.calibrated is not None else None
    if run is not None:
        _say(f"in the engine ({run.schedule}, {run.microbatches} micro-batches): step "
             f"{run.measured_ms:.3f} ms, work per action "
             f"{' / '.join(f'{a:.3f}' for a in run.action_ms)} ms, barrier "
             f"{run.barrier_ms:.3f} ms, hop "
             f"{' / '.join(f'{s:.3f}' for s in run.idle_send_ms)} ms idle + "
             f"{run.hop_ms:.3f} ms")
    predicted = done.plan.predicted
    shown = next((x for x in (predicted.bottleneck_ms, predicted.iteration_ms) if x is not None),
                 0.0)
    _say(f"wrote {done.out}: calibrated (round {done.chosen + 1} of {len(done.rounds)}, "
         f"{'optimum held' if done.converged else 'stopped at --rounds'}), bottleneck "
         f"{shown:.3f} ms, in {time.perf_counter() - started:.1f} s")
    return 0


def _bars() -> Reporter:
    """The reporter of a verb's long steps: bars on stderr, only when stderr is a terminal and
    -q is not given."""
    from onnx_partition.progress import Bars

    return Bars(enabled=log.isEnabledFor(logging.INFO))


def _progress_bar(label: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing a tqdm bar with its ETA on stderr, only
    when stderr is a terminal and -q is not given."""
    from onnx_partition.progress import progress_callback

    return progress_callback(label, enabled=log.isEnabledFor(logging.INFO))


def _partition(args: argparse.Namespace) -> int:
    from onnx_partition.cli.summary.partition import summary_lines, train_figures
    from onnx_partition.partition import partition_request
    from onnx_partition.request.resolve import resolve

    request = resolve(partition_options(args))
    stop_bar = _ilp_bar(args)
    plan = partition_request(request, reporter=_bars())
    stop_bar()
    for note in plan.costs.check.notes if plan.costs.check is not None else []:
        print(note, file=sys.stderr)
    if args.json:
        from onnx_partition.pipeline.predict import dumps, partition_json

        body = partition_json(plan, args.output)
        body.update(train_figures(plan, args.output) or {})  # a train plan's tokens and MFU
        print(dumps(body))
        return 0
    print("\n".join(summary_lines(plan, args.batch_size, args.output)))
    warning = getattr(plan.device_model, "warning", None)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    _say(f"wrote {_plural(len(plan.stages), 'stage')} and plan.json to {args.output} "
         f"in {plan.partition_s or 0:.2f} s")
    return 0


def partition_options(args: argparse.Namespace) -> PartitionOptions:
    """``partition``'s options as given (None where not given), for the one resolver
    (:func:`~onnx_partition.request.resolve.resolve`) that the Python API shares."""
    from onnx_partition.request.partition import (
        CostSource,
        DeviceOptions,
        PartitionOptions,
    )
    from onnx_partition.request.resolve import costs_of

    costs, kinds = costs_of(args.costs)
    devices = DeviceOptions(
        cluster=args.cluster, gpu=args.gpu, device_kind=args.device_kind,
        devices=args.devices, machines=args.machines, device_memory=args.device_memory,
        bandwidth=args.bandwidth, latency=args.latency, inter_bandwidth=args.inter_bandwidth,
        inter_latency=args.inter_latency, cpu_tflops=args.cpu_tflops, cpu_gbps=args.cpu_gbps)
    return PartitionOptions(
        args.model, args.output, args.stages, CostSource(costs, kinds, args.strict_costs),
        input_shapes_of(args), args.batch_size, devices, mode=args.mode,
        microbatches=args.microbatches, schedule=args.schedule, recompute=args.recompute,
        shard_optimizer=args.shard_optimizer or None, precision=args.precision,
        ordering=args.order, solver=args.solver, time_limit_s=args.time_limit,
        exact_budget_s=args.exact_budget, force=args.force,
        program_required=not args.no_program, analytic=args.analytic or None)


def _ilp_bar(args: argparse.Namespace) -> Callable[[], None]:
    """A bar over the ILP's time limit (its ETA) while partition runs; returns its stop."""
    from onnx_partition.progress import timed

    limit = args.time_limit if args.solver == "ilp" else 0.0
    bar = timed("ILP (CP-SAT)", limit, enabled=bool(limit) and log.isEnabledFor(logging.INFO))
    bar.__enter__()

    def stop() -> None:
        bar.__exit__(None, None, None)

    return stop


def _run(args: argparse.Namespace) -> int:
    """Run the plan as planned: its micro-batch size and count unless told, every replica fed
    (replica j of r takes micro-batches m = j mod r), then measured against predicted."""
    from onnx_partition.cli.summary.run import (
        TRAIN_PLAN_NOTE,
        format_comparison,
        idle_replicas_note,
        shape_line,
        timing_line,
    )
    from onnx_partition.pipeline.microbatch import batch_axes
    from onnx_partition.pipeline.predict import dumps, run_json, run_shape
    from onnx_partition.runtime.infer.check import run_feeds
    from onnx_partition.runtime.infer.measure import (
        measure_distributed,
        measure_threads,
        shape_of_feeds,
    )

    plan = read_plan(args.plan)
    if plan.weights == "none":
        raise PartitionError(
            f"plan {args.plan} has no weights (exported with --no-weights): export the model "
            "with its weights (without --no-weights) and partition that, or train the plan "
            "(`onnx-partition train PLAN --save OUT` makes them) and run what it saves")
    if args.iterations < 1 or args.warmup < 0:
        raise PartitionError("--iterations must be at least 1 and --warmup at least 0")
    if args.nproc is not None:  # before anything is printed
        from onnx_partition.runtime.launch.ranks import check_world_size

        check_world_size([s.replicas for s in plan.stages], args.nproc)
    shape = run_shape(plan, batch_size=args.batch_size, microbatches=args.microbatches)
    feeds = run_feeds(plan, args.input, rows=shape.rows, seed=args.seed)
    shape = shape_of_feeds(shape, feeds, batch_axes(plan))
    out = sys.stderr if args.json else sys.stdout
    note = idle_replicas_note(plan, shape.microbatches)
    if note:
        print(note, file=sys.stderr)
    if plan.mode == "train":  # its stage times are torch's, its run is onnxruntime's
        print(TRAIN_PLAN_NOTE, file=sys.stderr)
    print(shape_line(plan, shape), file=out)
    options = {"warmup": args.warmup, "iterations": args.iterations,
               "threads_per_stage": args.threads_per_stage}
    bar = not args.json and log.isEnabledFor(logging.INFO)
    if args.nproc is not None:
        runtime, measured, outputs = measure_distributed(
            args.plan, plan, feeds, shape, nproc=args.nproc, device=args.device,
            timeout_s=args.timeout, show_progress=bar, **options)
    else:
        runtime, measured, outputs = measure_threads(
            args.plan, plan, feeds, shape, providers=_providers(args), show_progress=bar,
            **options)
    body = run_json(plan, shape, runtime, measured, warmup=args.warmup)
    code = (_check(args.plan, plan, feeds, outputs, out, shape.microbatches) if args.check
            else 0)
    if args.check:
        body["check"] = "ok" if code == 0 else "mismatch"
    if args.json:
        print(dumps(body))
    else:
        print(format_comparison(body))
        print(timing_line(measured["iteration_ms_each"]))
    return code


def _providers(args: argparse.Namespace) -> list[str] | None:
    """``--device cpu``: every stage on onnxruntime's CPU provider, whatever the plan says."""
    return ["CPUExecutionProvider"] if args.device == "cpu" else None


def _check(
    plan_dir: Path, plan: Plan, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
    out: Any = None, microbatches: int = 1,
) -> int:
    """Compare pipelined outputs with the whole model's; exit code 1 on a mismatch."""
    from onnx_partition.cli.summary.run import check_line
    from onnx_partition.runtime.infer.check import compare, whole_model_outputs

    worst = compare(outputs, whole_model_outputs(plan_dir, plan, feeds,
                                                 microbatches=microbatches))
    verdict = "OK" if worst <= 1e-5 else "MISMATCH"
    print(check_line(worst, verdict), file=out or sys.stdout)
    return 0 if verdict == "OK" else 1


def _train(args: argparse.Namespace) -> int:
    from onnx_partition.cli.summary.train import format_train
    from onnx_partition.pipeline.predict import dumps
    from onnx_partition.request.train import priced_for, resolve_job, train_job
    from onnx_partition.runtime.train.results import train_json
    from onnx_partition.runtime.train.trainer import run_job

    plan = read_plan(args.plan)
    if plan.mode != "train":
        raise PartitionError(
            f"{args.plan} is an inference plan (--mode {plan.mode}): partition the model again "
            f"with --mode train (onnx-partition partition MODEL.onnx --mode train -o PLAN ...)")
    if plan.program:  # a program is code: say which one runs, before anything loads it
        _say(f"program {Path(args.plan) / plan.program} sha256 {plan.program_sha256} "
             "(code: train only plans you trust)")
    warning = plan_defaults(args, priced_for(plan))  # said after the figures it explains
    job, _ = resolve_job(train_job(**train_options(args)), plan)  # the choices: plan_defaults'
    stats = run_job(args.plan, job)
    print(dumps(train_json(stats)) if job.logging.json else format_train(stats))
    if warning:
        print(warning, file=sys.stderr)
    return EXIT_FAILED if stats.mismatches else 0


def _simulate(args: argparse.Namespace) -> int:
    from onnx_partition.cli.summary.simulate import format_simulation, samples_line
    from onnx_partition.pipeline.from_plan import simulate_plan
    from onnx_partition.pipeline.predict import dumps, rows_scale, simulate_json
    from onnx_partition.plan.folder import verify

    plan = read_plan(args.plan)
    verify(args.plan, plan, hashes=not args.no_verify)
    result, _ = simulate_plan(plan, schedule=args.schedule, microbatches=args.microbatches,
                              chunks=chunks_of(args),
                              rows_scale=rows_scale(plan, args.batch_size))
    body = simulate_json(plan, result, schedule=args.schedule, microbatches=args.microbatches,
                         batch_size=args.batch_size)
    if args.json:
        print(dumps(body))
        return 0
    print(format_simulation(plan, result))
    samples = samples_line(body)
    if samples:
        print(samples)
    return 0


def _report(args: argparse.Namespace) -> int:
    from onnx_partition.report import write_report

    path = write_report(args.plan, args.output, schedule=args.schedule,
                        microbatches=args.microbatches, chunks=chunks_of(args),
                        measured=args.measured, force=args.force,
                        hashes=not args.no_verify,
                        warn=lambda note: print(note, file=sys.stderr))
    _say(f"wrote {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="onnx-partition-demo-") as tmp:
            return _demo_in(args, Path(tmp))
    args.workdir.mkdir(parents=True, exist_ok=True)
    return _demo_in(args, args.workdir)


#: The demo's most stages: its tiny model cut finer is mostly hand-offs between threads.
DEMO_MAX_STAGES = 4


def _demo_cpus() -> int:
    """The CPUs this process may run on: its affinity where the OS has one (Linux), else the
    machine's count."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(1, len(affinity(0)))
    return max(1, os.cpu_count() or 1)


def _demo_steps(args: argparse.Namespace, work: Path, stages: int) -> list[list[str]]:
    """The demo's commands: export; time every node on this CPU; partition on those times, one
    stage per CPU; time the plan's stages in ``run``'s own pipeline, here (the thread hand-offs
    and the CPUs' sharing, which per-node times miss); run and check it."""
    model, costs, plan = work / f"{args.model}.onnx", work / "costs.json", work / "plan"
    batch = str(args.batch_size)
    return [
        ["export", args.model, "--size", args.size, "-o", str(model)],
        ["profile", str(model), "--batch-size", batch, "-o", str(costs)],
        ["partition", str(model), "--stages", str(stages), "--batch-size", batch,
         "--costs", str(costs), "-o", str(plan)],
        ["profile", "--plan", str(plan), "--rounds", "1"],
        ["run", str(plan), "--check"],  # the plan's micro-batch size and count
    ]


def _demo_in(args: argparse.Namespace, work: Path) -> int:
    cpus = _demo_cpus()
    stages = args.stages or min(cpus, DEMO_MAX_STAGES)
    if args.stages is None:
        _say(f"{_plural(cpus, 'CPU')} to run on here: {_plural(stages, 'stage')}, "
             "one per CPU (--stages chooses)")
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0  # before our own work
    for step in _demo_steps(args, work, stages):
        _say(f"$ onnx-partition {' '.join(step)}")
        code = main(["-q"] * args.quiet + ["-v"] * args.verbose + step)  # keep -q/-v
        if code:
            return code
    if stages > cpus:
        print(f"note: {_plural(stages, 'stage')} on {_plural(cpus, 'CPU')}: the stages share "
              "CPUs, which the plan does not price, so measured falls short of predicted",
              file=sys.stderr)
    elif busy > cpus - stages + 0.5:
        print(f"note: the load average was {busy:.2f} on {_plural(cpus, 'CPU')} before the "
              "demo started: other work shares the CPUs the stages run on, so the measured "
              "figures move with it", file=sys.stderr)
    return 0
