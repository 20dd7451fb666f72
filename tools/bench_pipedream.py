"""Our planner against PipeDream's own optimizer, side by side on the same graphs and costs.

    python tools/bench_pipedream.py PIPEDREAM_DIR [--work DIR] [--only bert gpt2]
        [--cases pipeline hybrid] [--seq-len 128] [--bandwidth 100] [--repeats 1]

PIPEDREAM_DIR is a local copy of msr-fiddle/pipedream (at least its ``optimizer/`` and
``graph/``, e.g. ``git archive 7db6a1c optimizer graph | tar -x -C DIR``); nothing is
downloaded. For Hugging Face BERT (6 layers) and GPT-2 (12 layers), built from their
transformers configs with random weights (``onnx-partition export --hf-config``, cached in
``--work``), at batch 8:

1. one cost profile, analytic H100 forward times per node (``costs.json``), read by both;
2. PipeDream's profile graph (``graph.txt``, the format of its ``graph/graph.py``): one node
   per operator with its forward time, its outputs' bytes as ``activation_size``, and an
   ``Input`` source per graph input (which its optimizer drops), edges along the tensors;
3. each planner as a fresh process: ``optimizer_graph_hierarchical.py -n 8`` (with
   ``--straight_pipeline`` for the 8-stage case) and ``onnx-partition partition --stages 8``
   (``--devices 8`` for the hybrid case), both in inference, both at ``--bandwidth``.

Both plan inference: PipeDream is given no backward time and no parameter bytes (an inference
replica all-reduces nothing), ``--activation_compression_ratio 1`` (else it ignores transfers)
and twice the bandwidth (it charges each boundary twice, for the activation and its gradient),
so its objective is the period an inference pipeline runs at. Its code runs unmodified, with
this interpreter, from its ``optimizer/`` folder; only ``import graphviz`` (used for drawings
it is not asked for) is made optional, in a copy, where graphviz is not installed.

Prints one Markdown row per case: PipeDream's process seconds, our ``partition_s`` (plan.json)
and our whole process, the ratios, and each plan's period per micro-batch as its own planner
states it (PipeDream's "Time per stage in pipeline", ours ``predicted.bottleneck_ms``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: name -> (transformers config class, its keywords, architecture)
MODELS: dict[str, tuple[str, dict[str, int], str]] = {
    "bert": ("BertConfig", {"num_hidden_layers": 6}, "BertForMaskedLM"),
    "gpt2": ("GPT2Config", {"n_layer": 12}, "GPT2LMHeadModel"),
}
CASES = ("pipeline", "hybrid")
DEVICES = 8
BATCH = 8


@dataclass(frozen=True)
class Run:
    """One planner's process: wall seconds, its planning seconds, the period it states."""

    wall_s: float
    plan_s: float | None
    period_ms: float


def export(name: str, work: Path, seq_len: int) -> Path:
    """The model's ONNX file in ``work`` (exported once, then reused)."""
    model = work / f"{name}.onnx"
    if model.exists():
        return model
    import transformers

    kind, shape, arch = MODELS[name]
    cfg = work / f"{name}_cfg"
    getattr(transformers, kind)(**shape, architectures=[arch]).save_pretrained(cfg)
    subprocess.run([sys.executable, "-m", "onnx_partition.cli", "export", "--hf-config",
                    str(cfg), "--seq-len", str(seq_len), "-o", str(model)], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return model


def write_inputs(model: Path, work: Path) -> tuple[Path, Path, int]:
    """costs.json (analytic H100 forward times) and PipeDream's graph.txt of ``model`` at
    batch ``BATCH``; the number of operators."""
    from onnx_partition.cost.analytic import DeviceSpec
    from onnx_partition.cost.annotate import annotate
    from onnx_partition.graph import load

    graph = load(model, batch_size=BATCH)
    forward = annotate(graph, device=DeviceSpec.gpu_h100()).forward_ms
    ops = [n for n in graph.nodes if not n.free]
    costs = work / f"{model.stem}_costs.json"
    costs.write_text(json.dumps({"format": "onnx-partition/costs@1", "unit": "ms",
                                 "device": "cuda", "nodes": {
                                     n.key: {"forward_ms": forward[n.index]} for n in ops}}))
    lines = [f"input{i} -- Input{i} -- forward_compute_time=0.0, backward_compute_time=0.0, "
             f"activation_size={float(graph.tensors[t].nbytes)}, parameter_size=0.0"
             for i, t in enumerate(graph.inputs)]
    for n in ops:
        size = sum(graph.tensors[t].nbytes for t in n.outputs if t in graph.tensors)
        lines.append(f"node{n.index} -- {n.op_type} -- forward_compute_time={forward[n.index]}, "
                     f"backward_compute_time=0.0, activation_size={float(size)}, "
                     "parameter_size=0.0")
    source = {t: f"input{i}" for i, t in enumerate(graph.inputs)}
    edges: dict[tuple[str, str], None] = {}
    for name, tensor in graph.tensors.items():
        tail = source.get(name) if tensor.producer < 0 else f"node{tensor.producer}"
        if tail is None:
            continue
        for c in tensor.consumers:
            if not graph.nodes[c].free:
                edges[tail, f"node{c}"] = None
    lines += [f"\t{a} -- {b}" for a, b in edges]
    profile = work / f"{model.stem}_graph.txt"
    profile.write_text("\n".join(lines) + "\n")
    return costs, profile, len(ops)


def optimizer_dir(pipedream: Path, work: Path) -> Path:
    """PipeDream's ``optimizer/`` to run from: its own, or a copy whose ``graph/graph.py``
    imports graphviz only if installed (it draws with it; this benchmark asks for no drawing)."""
    for part in ("optimizer/optimizer_graph_hierarchical.py", "graph/graph.py"):
        if not (pipedream / part).is_file():
            raise SystemExit(f"error: {pipedream} has no {part} (a copy of msr-fiddle/pipedream)")
    if importlib.util.find_spec("graphviz") is not None:
        return pipedream / "optimizer"
    copy = work / "pipedream"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(pipedream / "optimizer", copy / "optimizer")
    shutil.copytree(pipedream / "graph", copy / "graph")
    graph_py = copy / "graph" / "graph.py"
    graph_py.write_text(graph_py.read_text().replace(
        "import graphviz\n", "try:\n    import graphviz\nexcept ImportError:\n"
        "    graphviz = None\n", 1))
    return copy / "optimizer"


def run_pipedream(optimizer: Path, profile: Path, case: str, bandwidth_gbps: float,
                  timeout_s: float) -> Run | None:
    """PipeDream's optimizer on ``profile``, one fresh process; None past ``timeout_s``."""
    argv = [sys.executable, "optimizer_graph_hierarchical.py", "-f", str(profile), "-n",
            str(DEVICES), "-b", str(2 * bandwidth_gbps * 1e9),
            "--activation_compression_ratio", "1"]
    if case == "pipeline":
        argv.append("--straight_pipeline")
    began = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=optimizer, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    wall = time.perf_counter() - began
    found = re.search(r"Time per stage in pipeline: (\S+)", done.stdout)
    if done.returncode or found is None:
        raise SystemExit(f"PipeDream failed ({done.returncode}): {done.stderr[-500:]}")
    return Run(wall, None, float(found.group(1)) * 1e3)  # its times are ms / 1000


def run_ours(model: Path, costs: Path, case: str, bandwidth_gbps: float, out: Path) -> Run:
    """``onnx-partition partition`` on ``model`` with ``costs``, one fresh process."""
    shape = ["--stages", str(DEVICES)] if case == "pipeline" else ["--devices", str(DEVICES)]
    argv = [sys.executable, "-m", "onnx_partition.cli", "partition", str(model), *shape,
            "--batch-size", str(BATCH), "--gpu", "h100", "--costs", str(costs), "--bandwidth",
            str(bandwidth_gbps), "--latency", "0", "-o", str(out), "--force"]
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"onnx-partition failed ({done.returncode}): {done.stderr[-500:]}")
    plan = json.loads((out / "plan.json").read_text())
    return Run(wall, float(plan["partition_s"]), float(plan["predicted"]["bottleneck_ms"]))


def row(name: str, case: str, ops: int, ours: list[Run], theirs: list[Run | None],
        timeout_s: float) -> str:
    """One Markdown row: medians of the runs; PipeDream past its limit shows as ``> limit``
    (its ratios then lower bounds)."""
    plan_s = statistics.median(r.plan_s or 0.0 for r in ours)
    cmd_s = statistics.median(r.wall_s for r in ours)
    done = [r for r in theirs if r is not None]
    if len(done) < len(theirs):
        pd_s, over, period = timeout_s, "> ", "(none)"
    else:
        pd_s, over = statistics.median(r.wall_s for r in done), ""
        period = f"{done[0].period_ms:.4f}"
    return (f"| {name} | {case} | {ops} | {over}{pd_s:.2f} | {plan_s:.2f} | {cmd_s:.2f} | "
            f"{over}{pd_s / plan_s:.1f}x | {over}{pd_s / cmd_s:.1f}x | {period} | "
            f"{ours[0].period_ms:.4f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pipedream", type=Path, help="local copy of msr-fiddle/pipedream")
    parser.add_argument("--work", type=Path, help="folder for models and files (default: temp)")
    parser.add_argument("--only", nargs="*", choices=list(MODELS), help="models to run")
    parser.add_argument("--cases", nargs="*", choices=CASES, help="cases to run")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length")
    parser.add_argument("--bandwidth", type=float, default=100.0, help="link GB/s, both")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each; medians shown")
    parser.add_argument("--pipedream-timeout", type=float, default=600.0,
                        help="seconds PipeDream may run (past it: shown as > the limit)")
    args = parser.parse_args()
    if args.repeats < 1 or args.seq_len < 1 or args.bandwidth <= 0:
        parser.error("--repeats and --seq-len must be >= 1, --bandwidth > 0")
    print("| model | case | operators | PipeDream s | our partition_s | our command s | "
          "PipeDream / partition_s | PipeDream / command | PipeDream period ms | "
          "our period ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        optimizer = optimizer_dir(args.pipedream.resolve(), work)
        for name in args.only or list(MODELS):
            model = export(name, work, args.seq_len)
            costs, profile, ops = write_inputs(model, work)
            for case in args.cases or CASES:
                ours = [run_ours(model, costs, case, args.bandwidth, work / f"{name}-{case}")
                        for _ in range(args.repeats)]
                theirs = [run_pipedream(optimizer, profile, case, args.bandwidth,
                                        args.pipedream_timeout) for _ in range(args.repeats)]
                print(row(name, case, ops, ours, theirs, args.pipedream_timeout), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
