"""The ``onnx-partition`` command: export, partition, run, demo.

Bad input prints ``error: <one line>`` and exits with code 2; a run whose outputs differ from the
whole model's exits with code 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from onnx_partition.cost.cluster import Cluster, LinkSpec, load_cluster, parse_bytes
from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan, read_plan

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def main(argv: Sequence[str] | None = None) -> int:
    from onnx_partition.runtime.pipeline import StageFailed

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except PartitionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StageFailed as exc:  # a stage raised or a worker died while running
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-partition",
        description="Cut an ONNX model into pipeline stages and run them as a pipeline.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("export", help="export a model recipe from models/ to ONNX")
    p.add_argument("name", help="recipe: resnet, inception, unet, gpt, bert, encdec")
    p.add_argument("--size", default="tiny", help="tiny | small | realistic (default tiny)")
    p.add_argument("--batch-size", type=int, default=2, help="example batch used for tracing")
    p.add_argument("-o", "--output", required=True, type=Path, help="ONNX file to write")
    p.set_defaults(func=_export)

    p = verbs.add_parser("profile", help="measure every node's time on a device -> costs.json")
    p.add_argument("model", type=Path)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    _shape_args(p)
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median taken)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    p.add_argument("-o", "--output", required=True, type=Path, help="costs.json to write")
    p.set_defaults(func=_profile)

    p = verbs.add_parser("partition", help="cut a model into stage files and plan.json")
    p.add_argument("model", type=Path)
    p.add_argument("--stages", "-s", type=int,
                   help="number of pipeline stages (with a cluster: fix the depth, else chosen)")
    p.add_argument("-o", "--output", required=True, type=Path, help="plan folder to write")
    p.add_argument("--costs", type=Path, help="costs.json (contract format); else analytic")
    _shape_args(p)
    p.add_argument("--bandwidth", type=float, default=10.0,
                   help="link bandwidth between stages in GB/s, and between the devices of a "
                        "machine with --devices (default 10; 0 = free)")
    p.add_argument("--latency", type=float, default=0.02, help="link latency in ms")
    p.add_argument("--order", default="auto", choices=("auto", "topo", "dfs", "minlive", "cluster"),
                   help="how to sequence the DAG before the DP (default auto: try all, keep best)")
    p.add_argument("--solver", default="dp", choices=("dp", "ilp", "uniform", "parameters", "time"),
                   help="dp (default), ilp (exact OR-Tools CP-SAT over the DAG, seeded by dp), "
                        "or a baseline: uniform (equal operator counts), parameters (equal "
                        "weights), time (equal compute, no communication)")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds")
    g = p.add_argument_group("hybrid parallelism (stages x data-parallel replicas)")
    g.add_argument("--devices", type=int, help="devices per machine: plan replicas per stage")
    g.add_argument("--machines", type=int, default=1, help="machines (default 1)")
    g.add_argument("--device-memory", help="memory per device, e.g. 80GB (default: unlimited)")
    g.add_argument("--device-kind", default="cpu", choices=("cpu", "cuda"))
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
    p.set_defaults(func=_partition)

    p = verbs.add_parser("run", help="run a plan folder as a pipeline and measure it")
    p.add_argument("plan", type=Path)
    p.add_argument("--batch-size", type=int, help="rows per batch (default: as partitioned)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads-per-stage", type=int, default=1)
    p.add_argument("--nproc", type=int,
                   help="run one process per stage replica over torch.distributed (gloo on "
                        "CPU, NCCL on GPUs) instead of threads; must equal the plan's replicas")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="feed an input from a .npy file (repeatable); others are random")
    p.add_argument("--check", action="store_true",
                   help="compare outputs with the whole model run in one session")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)

    p = verbs.add_parser("simulate", help="simulate a plan's schedule: time, bubbles, memory")
    p.add_argument("plan", type=Path)
    _schedule_args(p)
    p.set_defaults(func=_simulate)

    p = verbs.add_parser("report", help="write a self-contained HTML report of a plan")
    p.add_argument("plan", type=Path)
    p.add_argument("-o", "--output", type=Path, help="default: PLAN/report.html")
    _schedule_args(p)
    p.set_defaults(func=_report)

    p = verbs.add_parser("demo", help="export a recipe, partition it, run it, check it")
    p.add_argument("--model", default="gpt", help="recipe name (default gpt)")
    p.add_argument("--size", default="tiny")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workdir", type=Path, help="keep files here (default: a temporary folder)")
    p.set_defaults(func=_demo)
    return parser


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "infer"),
                   help="default: 1f1b for training plans, infer otherwise; interleaved: "
                        "interleaved 1F1B, the stages as --chunks model chunks per device")
    p.add_argument("--microbatches", type=int, help="default: the plan's")
    p.add_argument("--chunks", type=int,
                   help="model chunks per device for --schedule interleaved (default 2); "
                        "must divide the stage count")


def _chunks(args: argparse.Namespace) -> int | None:
    """``--chunks``, which only the interleaved schedule takes."""
    if args.chunks is not None and args.schedule != "interleaved":
        raise PartitionError("--chunks needs --schedule interleaved")
    return args.chunks


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an input's shape (repeatable)")
    p.add_argument("--batch-size", type=int, help="fix a symbolic leading (batch) dim")


def parse_input_shapes(items: Sequence[str]) -> dict[str, list[int]]:
    """``NAME=2,3,224`` items -> {NAME: [2, 3, 224]}; a clear error otherwise."""
    shapes: dict[str, list[int]] = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        try:
            values = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
        except ValueError:
            values = []
        if not sep or not name or not values or min(values) < 0:
            raise PartitionError(f"--input-shape {item!r}: expected NAME=D0,D1,... (integers)")
        shapes[name] = values
    return shapes


# --------------------------------------------------------------------------- verbs


def _export(args: argparse.Namespace) -> int:
    import models

    try:
        started = time.perf_counter()
        path = models.export(args.name, args.output, size=args.size, batch_size=args.batch_size)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    print(f"wrote {path} and its program {path.with_suffix('.pt2').name} ({args.name}, "
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
    print(f"wrote {args.output}: {len(result.forward_ms)} nodes on {result.device}, "
          f"whole model {result.whole_model_ms:.3f} ms (per-node sum before calibration "
          f"{result.raw_sum_ms:.3f} ms), {result.unique_signatures} distinct operators measured, "
          f"{result.reused} reused, in {time.perf_counter() - started:.1f} s")
    return 0


def _progress_bar(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""
    tty = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        if not tty or total <= 0:
            return
        width = 30
        filled = int(width * done / total)
        end = "\n" if done >= total else ""
        print(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
              end=end, file=sys.stderr, flush=True)

    return show


def _partition(args: argparse.Namespace) -> int:
    from onnx_partition.partition import Link, partition
    from onnx_partition.report import plan_table

    if args.stages is not None and args.stages < 1:
        raise PartitionError(f"--stages must be at least 1, got {args.stages}")
    if args.microbatches < 1:
        raise PartitionError(f"--microbatches must be at least 1, got {args.microbatches}")
    plan = partition(
        args.model,
        args.stages,
        args.output,
        costs=args.costs,
        input_shapes=parse_input_shapes(args.input_shape),
        batch_size=args.batch_size,
        link=Link(args.bandwidth, args.latency),
        cluster=_cluster(args),
        mode=args.mode,
        microbatches=args.microbatches,
        ordering=args.order,
        solver=args.solver,
        time_limit_s=args.time_limit,
        force=args.force,
    )
    print(plan_table(plan))
    print(f"wrote {len(plan.stages)} stages and plan.json to {args.output} "
          f"in {plan.extra.get('partition_s', 0):.2f} s")
    return 0


def _cluster(args: argparse.Namespace) -> Cluster | None:
    """The cluster the options describe, or None for a plain pipeline of --stages devices."""
    if args.cluster is not None:
        return load_cluster(args.cluster)
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
    default = Cluster()
    return Cluster(machines=args.machines, devices_per_machine=args.devices, memory_gb=memory,
                   kind=args.device_kind, intra=LinkSpec(args.bandwidth, args.latency),
                   inter=LinkSpec(
                       default.inter.bandwidth_gbps if args.inter_bandwidth is None
                       else args.inter_bandwidth,
                       default.inter.latency_ms if args.inter_latency is None
                       else args.inter_latency))


def _run(args: argparse.Namespace) -> int:
    from onnx_partition.runtime import PipelineSession
    from onnx_partition.runtime.check import random_feeds

    plan = read_plan(args.plan)
    feeds = random_feeds(plan, batch_size=args.batch_size, seed=args.seed)
    for item in args.input:
        name, sep, file = item.partition("=")
        if not sep or name not in feeds:
            raise PartitionError(f"--input {item!r}: expected NAME=FILE.npy with NAME one of "
                                 f"{', '.join(feeds)}")
        try:
            feeds[name] = np.load(file)
        except (OSError, ValueError) as exc:
            raise PartitionError(f"--input {item!r}: cannot read {file}: {exc}") from None
    if args.nproc is not None:
        return _run_distributed(args, plan, feeds)
    session = PipelineSession(args.plan, microbatches=args.microbatches,
                              threads_per_stage=args.threads_per_stage)
    rows = next(iter(v.shape[0] for v in feeds.values() if v.ndim), 1)
    for _ in range(args.warmup):
        outputs = session.run(None, feeds)
    began = time.perf_counter()
    busy: dict[tuple[int, int], float] = {}
    for _ in range(max(1, args.iterations)):
        outputs = session.run(None, feeds)
        for key, ms in session.last_stats.busy_ms.items():
            busy[key] = busy.get(key, 0.0) + ms
    seconds = time.perf_counter() - began
    iters = max(1, args.iterations)
    print(f"{len(session.stages)} stages, batch {rows} in {session.microbatches} micro-batches: "
          f"{rows * iters / seconds:.1f} samples/s ({seconds / iters * 1000:.2f} ms per batch)")
    for (stage, replica), ms in sorted(busy.items()):
        print(f"  stage {stage} replica {replica}: busy {ms / iters:.2f} ms per batch "
              f"({ms / (seconds * 1000) * 100:.0f}% of wall)")
    if args.check:
        return _check(args.plan, plan, feeds, dict(zip(session.get_outputs(), outputs)))
    return 0


def _run_distributed(
    args: argparse.Namespace, plan: Plan, feeds: dict[str, np.ndarray]
) -> int:
    from onnx_partition.runtime.distributed import format_stats, run_distributed

    outputs, stats = run_distributed(
        args.plan, feeds, nproc=args.nproc, microbatches=args.microbatches,
        iterations=max(1, args.warmup + args.iterations),
        threads_per_stage=args.threads_per_stage,
    )
    print(format_stats(stats))
    return _check(args.plan, plan, feeds, outputs) if args.check else 0


def _check(
    plan_dir: Path, plan: Plan, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]
) -> int:
    """Compare pipelined outputs with the whole model's; exit code 1 on a mismatch."""
    from onnx_partition.runtime.check import compare, whole_model_outputs

    worst = compare(outputs, whole_model_outputs(plan_dir, plan, feeds))
    verdict = "OK" if worst <= 1e-5 else "MISMATCH"
    print(f"check against the whole model: max relative error {worst:.2e} ({verdict})")
    return 0 if verdict == "OK" else 1


def _simulate(args: argparse.Namespace) -> int:
    from onnx_partition.plan_sim import format_simulation, simulate_plan

    plan = read_plan(args.plan)
    result, _ = simulate_plan(plan, schedule=args.schedule, microbatches=args.microbatches,
                              chunks=_chunks(args))
    print(format_simulation(plan, result))
    return 0


def _report(args: argparse.Namespace) -> int:
    from onnx_partition.report import write_report

    path = write_report(args.plan, args.output, schedule=args.schedule,
                        microbatches=args.microbatches, chunks=_chunks(args))
    print(f"wrote {path}")
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
        ["run", str(plan), "--batch-size", str(args.batch_size), "--check"],
    ]
    for step in steps:
        print(f"$ onnx-partition {' '.join(step)}", flush=True)
        code = main(step)
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
