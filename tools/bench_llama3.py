"""Llama 3 at the scale people train it: weightless export and plan of the 8B, 70B and 405B rows.

    python tools/bench_llama3.py [--only 8b 70b 405b] [--work DIR] [--max-gb 12]
        [--inter-bandwidth GBPS] [--stages NAME=K ...]

Each config carries the published shapes (written as ``config.json``, nothing downloaded) and is
trained in bf16 with AdamW, sequence 8,192, one sequence per micro-batch, the optimizer state
sharded, the schedule and recomputation chosen by the planner. Each step is a fresh process,
timed by ``os.wait4`` (wall seconds, peak RSS) under an address-space limit of ``--max-gb``:

    onnx-partition export --hf-config CFG --no-weights --seq-len 8192 -o model.onnx
    onnx-partition partition model.onnx --mode train --devices 8 --machines N --gpu h100
        --batch-size 1 --precision bf16 --microbatches M --schedule auto --recompute auto
        --shard-optimizer [--stages K] [--inter-bandwidth GBPS] -o plan

(an export already in ``--work`` is reused; each step's stderr is written to
``--work``/NAME/STEP.log as it runs). Prints one Markdown row per model: devices, the
plan (stages x replicas), the simulated step, tokens/s, tokens/s per GPU used, MFU (``6 P T /
(step x GPUs x 989.4 TFLOP/s)``, H100 SXM's dense bf16 peak, ``P`` the ONNX floating-point
initializers' elements, ``T`` the tokens of one step: :mod:`onnx_partition.mfu`, as
``partition``'s summary prints them), the planning wall seconds and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ = 8192
H100_BF16_FLOPS = 989.4e12  # dense, SXM5 (onnx_partition/cost/devices.py)
#: name -> (hidden, layers, heads, KV heads, MLP, machines of 8 H100, micro-batches)
ROWS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "8b": (4096, 32, 32, 8, 14336, 1, 512),
    "70b": (8192, 80, 64, 8, 28672, 128, 2048),
    "405b": (16384, 126, 128, 8, 53248, 2048, 2048),
}
#: the pipeline depth fixed with --stages (else chosen, at most 16): the 405B at 16 stages puts
#: 8 layers on each device (25 B parameters: 204 GB of fp32 weights and gradients, 12.75 GB of
#: each per layer in its plan), over an H100's 79.5 GB whatever the replicas, so a stage holds
#: one of its 126 layers (docs/benchmarks.md)
DEPTH: dict[str, int] = {"405b": 126}


def write_config(folder: Path, name: str) -> None:
    """A Llama 3 ``config.json`` with the published shapes (vocabulary 128,256)."""
    hidden, layers, heads, kv, mlp, _, _ = ROWS[name]
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv,
              "intermediate_size": mlp, "vocab_size": 128256, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": SEQ,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def timed(argv: list[str], max_gb: float, log: Path) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS GB, exit code, last stderr lines) of one fresh process whose
    address space is limited to ``max_gb``; its stderr goes to ``log`` as it runs (how far a
    step got when it is stopped)."""
    limit = int(max_gb * 1e9)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    with log.open("wb") as err:
        child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                 preexec_fn=cap)
        _, status, usage = os.wait4(child.pid, 0)
    said = log.read_text(errors="replace").strip().splitlines()
    return (time.perf_counter() - began, usage.ru_maxrss / 1e6,
            os.waitstatus_to_exitcode(status), " / ".join(said[-2:]))


def row(name: str, work: Path, max_gb: float, inter_gbps: float | None = None,
        depth: int | None = None) -> str:
    """One model's Markdown row (or how far it got); ``inter_gbps``: the link between
    machines (None: ``partition``'s default, 10 GbE); ``depth``: ``--stages`` (None: the
    planner's choice)."""
    _, _, _, _, _, machines, microbatches = ROWS[name]
    folder = work / name
    model, plan = folder / "model.onnx", folder / "plan"
    cli = [sys.executable, "-m", "onnx_partition.cli"]
    devices = machines * 8
    head = f"| Llama-3-{name.upper()} | {devices:,} H100 ({machines} x 8), M = {microbatches:,}"
    export = "reused"
    if not model.exists():
        write_config(folder / "cfg", name)
        wall, rss, code, said = timed([*cli, "export", "--hf-config", str(folder / "cfg"),
                                       "--no-weights", "--seq-len", str(SEQ), "-o",
                                       str(model)], max_gb, folder / "export.log")
        export = f"{wall:.0f} s, {rss:.2f} GB"
        if code:
            return f"{head} | export failed (exit {code}, {export}): {said} |"
    wall, rss, code, said = timed([
        *cli, "partition", str(model), "--mode", "train", "--devices", "8", "--machines",
        str(machines), "--gpu", "h100", "--batch-size", "1", "--precision", "bf16",
        "--microbatches", str(microbatches), "--schedule", "auto", "--recompute", "auto",
        "--shard-optimizer", *(["--stages", str(depth)] if depth else []),
        *(["--inter-bandwidth", str(inter_gbps)] if inter_gbps else []),
        "-o", str(plan), "--force"], max_gb, folder / "partition.log")
    if code:
        return f"{head} | {export} | plan failed (exit {code}, {wall:.0f} s, {rss:.2f} GB): " \
               f"{said} |"
    from onnx_partition.mfu import model_parameters, train_rates
    from onnx_partition.plan import read_plan

    planned = read_plan(plan)
    params = model_parameters(model)
    step_ms = float(planned.predicted.iteration_ms or math.nan)
    used = planned.predicted.devices_used or devices
    tokens = microbatches * SEQ  # one sequence per micro-batch
    rates = train_rates(params, tokens, step_ms, used, H100_BF16_FLOPS)
    shape = " + ".join(f"{s.replicas}" for s in planned.stages)
    return (f"{head} | {export} | {params / 1e9:.2f} B | {len(planned.stages)} stages x "
            f"[{shape}] on {used:,} | {step_ms / 1000:.2f} s | {rates.tokens_per_s:,.0f} | "
            f"{rates.tokens_per_s_per_gpu:,.0f} | {rates.mfu or 0:.1%} | {wall:.1f} s | "
            f"{rss:.2f} GB |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="rows to run")
    parser.add_argument("--work", type=Path, help="folder for the files (default: temporary)")
    parser.add_argument("--max-gb", type=float, default=12.0,
                        help="address-space limit of each step (default 12)")
    parser.add_argument("--inter-bandwidth", type=float, metavar="GBPS",
                        help="link between machines in GB/s (default: partition's, 10 GbE; "
                             "the Llama 3 paper's cluster: 400 Gb/s RoCE per GPU, 50)")
    parser.add_argument("--stages", nargs="*", default=[], metavar="NAME=K",
                        help="a row's pipeline depth (K, or auto: the planner's choice, at most "
                             f"16); default {' '.join(f'{k}={v}' for k, v in DEPTH.items())}")
    args = parser.parse_args()
    depth: dict[str, int | None] = dict(DEPTH)
    for item in args.stages:
        name, _, k = item.partition("=")
        if name not in ROWS or not (k == "auto" or (k.isdigit() and int(k) > 0)):
            parser.error(f"--stages {item}: want NAME=K or NAME=auto, NAME one of "
                         f"{', '.join(ROWS)}")
        depth[name] = None if k == "auto" else int(k)
    print("| model | cluster | export (wall, peak RSS) | parameters | plan (replicas per "
          "stage) | step | tokens/s | tokens/s per GPU | MFU | planning (wall) | "
          "planning peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in args.only or list(ROWS):
            print(row(name, work, args.max_gb, args.inter_bandwidth, depth.get(name)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
