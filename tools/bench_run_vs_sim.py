"""`run`'s measured throughput against `simulate`'s, every recipe at 2 stages, profile costs.

    python tools/bench_run_vs_sim.py [--recipes resnet,inception,unet,gpt,bert,encdec]
        [--size small] [--batch-size 4] [--microbatches 8] [--iterations 10] [--stages 2]
        [--calibrate] [--repeats 10] [--rounds 3]

For each recipe, exactly as a user would on the command line: ``export``; ``profile`` at the
micro-batch size (``--batch-size``: rows per micro-batch, as in every command); ``partition -s 2
--costs costs.json`` (shapes from the costs file); ``simulate --json`` (the prediction); ``run
--json`` (threads: one worker thread per stage, one onnxruntime thread each; the plan's
micro-batch size and count). Prints a Markdown table: predicted and measured samples/s, their
ratio, and per stage the measured busy time over the predicted one (above 1: the stage computes
slower inside the pipeline than the profile measured it alone), and this machine's ceiling
(how much faster two single-threaded sessions run side by side than one after another).

``--calibrate`` then runs ``profile --plan`` on the plan (each stage alone and side by side,
re-priced, re-cut if the optimum moves: issue 20 item 6) and ``simulate`` and ``run`` again,
and prints a second table: run / simulate before and after, the calibrated stage times, the
rounds, and the load average when each recipe finished (others share this machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from onnx_partition import models
from onnx_partition.cli import main as cli
from onnx_partition.cost.profile import CACHE_ENV
from onnx_partition.graph.ort import session_options
from onnx_partition.plan.declare import json_of


def cli_json(argv: list[str]) -> dict[str, Any]:
    """Run an ``onnx-partition`` verb with ``--json``; its one JSON object."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli([*argv, "--json"])
    if code:
        raise SystemExit(f"onnx-partition {' '.join(argv)} failed with exit code {code}")
    return json.loads(out.getvalue())


def quiet(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        if cli(argv):
            raise SystemExit(f"onnx-partition {' '.join(argv)} failed")


def side_by_side(model: Path, feeds: dict[str, Any], copies: int = 2, runs: int = 10) -> float:
    """How much faster ``copies`` single-threaded sessions run side by side than in turn."""
    sessions = [ort.InferenceSession(str(model), session_options(1),
                                     providers=["CPUExecutionProvider"]) for _ in range(copies)]
    for s in sessions:
        s.run(None, feeds)
    began = time.perf_counter()
    for _ in range(runs):
        sessions[0].run(None, feeds)
    alone = (time.perf_counter() - began) / runs
    threads = [threading.Thread(target=lambda s=s: [s.run(None, feeds) for _ in range(runs)])
               for s in sessions]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return copies * alone / ((time.perf_counter() - began) / runs)


def measure(recipe: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from onnx_partition.plan import read_plan
    from onnx_partition.runtime.infer.check import random_feeds

    model = models.export(recipe, work / f"{recipe}.onnx", size=args.size)
    costs, plan = work / f"{recipe}.costs.json", work / f"{recipe}.plan"
    quiet(["profile", str(model), "--batch-size", str(args.batch_size), "-o", str(costs)])
    quiet(["partition", str(model), "-s", str(args.stages), "--costs", str(costs),
           "--microbatches", str(args.microbatches), "-o", str(plan), "--force"])
    sim = cli_json(["simulate", str(plan), "--microbatches", str(args.microbatches)])
    run = cli_json(["run", str(plan), "--microbatches", str(args.microbatches),
                    "--iterations", str(args.iterations), "--warmup", "2"])
    feeds = random_feeds(read_plan(plan), batch_size=args.batch_size)
    row = {"recipe": recipe, "sim": sim, "run": run,
           "ceiling": side_by_side(model, feeds, args.stages)}
    if args.calibrate:
        began = time.perf_counter()
        quiet(["profile", "--plan", str(plan), "--repeats", str(args.repeats),
               "--rounds", str(args.rounds)])
        row["calibrate_s"] = time.perf_counter() - began
        row["calibrated"] = json_of(read_plan(plan).calibrated)
        row["sim_after"] = cli_json(["simulate", str(plan), "--microbatches",
                                     str(args.microbatches)])
        row["run_after"] = cli_json(["run", str(plan), "--microbatches", str(args.microbatches),
                                     "--iterations", str(args.iterations), "--warmup", "2"])
    row["load"] = os.getloadavg()[0]
    return row


def calibrated_table(rows: list[dict[str, Any]]) -> None:
    """run / simulate before and after ``profile --plan``, and what calibration measured."""
    print("\n| recipe | run / simulate before | run / simulate after | stage ms priced -> "
          "side by side | rounds (chosen) | calibrate s | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        def ratio(run: dict[str, Any], sim: dict[str, Any]) -> float:
            return float(run["measured"]["samples_per_s"] / sim["samples_per_s"])

        cal = row["calibrated"]
        first = cal["rounds"][0]
        stages = " / ".join(f"{p:.1f}->{t:.1f}" for p, t in zip(first["priced_ms"],
                                                               first["together_ms"]))
        moved = "held" if cal["converged"] else "moved"
        print(f"| {row['recipe']} | {ratio(row['run'], row['sim']):.2f} | "
              f"{ratio(row['run_after'], row['sim_after']):.2f} | {stages} | "
              f"{len(cal['rounds'])} ({cal['chosen_round']}, {moved}) | "
              f"{row['calibrate_s']:.1f} | {row['load']:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="resnet,inception,unet,gpt,bert,encdec")
    parser.add_argument("--size", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--calibrate", action="store_true",
                        help="then profile --plan, and simulate and run again")
    parser.add_argument("--repeats", type=int, default=10, help="profile --plan's repeats")
    parser.add_argument("--rounds", type=int, default=3, help="profile --plan's rounds")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault(CACHE_ENV, str(Path(tmp) / "cache"))
        for recipe in args.recipes.split(","):
            rows.append(measure(recipe, args, Path(tmp)))
            print(f"done {recipe}", file=sys.stderr, flush=True)
    print(f"{args.size} recipes, {args.stages} stages, {args.microbatches} micro-batches x "
          f"{args.batch_size} rows, {os.cpu_count()} CPUs, onnxruntime {ort.__version__}, "
          f"python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}")
    print("\n| recipe | stage compute ms (predicted) | simulate samples/s | run samples/s "
          "| run / simulate | stage busy run / predicted | stage CPU time run / predicted "
          "| 2 sessions side by side |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        sim, run = row["sim"], row["run"]
        compute = " / ".join(f"{s['compute_ms']:.2f}" for s in sim["stages"])
        busy = " / ".join(f"{r:.2f}" if r is not None else "-"
                          for r in run["ratio"]["stage_busy_ms"])
        cpu = " / ".join(f"{r:.2f}" if r is not None else "-"
                         for r in run["ratio"]["stage_cpu_ms"])
        ratio = run["measured"]["samples_per_s"] / sim["samples_per_s"]
        print(f"| {row['recipe']} | {compute} | {sim['samples_per_s']:.1f} | "
              f"{run['measured']['samples_per_s']:.1f} | {ratio:.2f} | {busy} | {cpu} | "
              f"{row['ceiling']:.2f}x |")
    if args.calibrate:
        calibrated_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
