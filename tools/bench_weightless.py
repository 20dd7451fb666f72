"""What a weightless export and plan cost: time, peak memory and file sizes against the weights.

    python tools/bench_weightless.py [--only NAME ...] [--work DIR]

For each Llama config below (written with ``transformers.LlamaConfig.save_pretrained``, nothing
downloaded) runs, each a fresh process timed by ``os.wait4`` (wall seconds, peak RSS):

    onnx-partition export --hf-config CFG --no-weights --seq-len S -o model.onnx
    onnx-partition partition model.onnx --mode train --devices 8 --gpu h100 --batch-size 1
        --precision bf16 -o plan

and prints one Markdown row per model: parameters (the ONNX initializers' dims), their fp32
bytes, the ONNX file and program sizes, each step's seconds and peak RSS, and the plan's
predicted tokens/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: name -> (LlamaConfig keywords, sequence length)
MODELS: dict[str, tuple[dict[str, int | float], int]] = {
    "llama-tiny": ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128},
                   1024),
    "llama-8x1024": ({"num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
                      "num_key_value_heads": 4, "intermediate_size": 4096,
                      "vocab_size": 32000}, 2048),
    "llama-3-8b": ({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 14336,
                    "vocab_size": 128256, "rope_theta": 500000.0}, 8192),
}


def _timed(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MB, exit code) of one fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    if child.stderr is not None:
        said = child.stderr.read().decode().strip().splitlines()
        child.stderr.close()
        if os.waitstatus_to_exitcode(status) != 0:
            print("\n".join(said[-3:]), file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def _sig(value: float) -> str:
    """Three significant digits, thousands separated, never in scientific notation."""
    return f"{value:,.0f}" if value >= 100 else f"{float(f'{value:.3g}'):,}"


def _row(name: str, work: Path) -> str:
    import transformers

    shape, seq = MODELS[name]
    cfg = work / name / "cfg"
    transformers.LlamaConfig(**shape, max_position_embeddings=seq,  # type: ignore[arg-type]
                             architectures=["LlamaForCausalLM"]).save_pretrained(cfg)
    model, plan = work / name / "model.onnx", work / name / "plan"
    cli = [sys.executable, "-m", "onnx_partition.cli"]
    export = _timed([*cli, "export", "--hf-config", str(cfg), "--no-weights", "--seq-len",
                     str(seq), "-o", str(model)])
    part = _timed([*cli, "partition", str(model), "--mode", "train", "--devices", "8", "--gpu",
                   "h100", "--batch-size", "1", "--precision", "bf16", "-o", str(plan),
                   "--force"])
    if export[2] or part[2]:
        return f"| {name} | failed: export exit {export[2]}, partition exit {part[2]} |"
    import math

    import onnx

    from onnx_partition.plan import read_plan

    planned = read_plan(plan)
    inits = onnx.load(str(model), load_external_data=False).graph.initializer
    params = sum(math.prod(t.dims) for t in inits)
    tokens = (planned.predicted.throughput_per_s or 0.0) * seq
    onnx_mb = model.stat().st_size / 1e6
    program_mb = model.with_suffix(".pt2").stat().st_size / 1e6
    return (f"| {name} (seq {seq:,}) | {_sig(params / 1e6)} M | {_sig(params * 4 / 1e9)} GB | "
            f"{onnx_mb:.1f} MB + {program_mb:.1f} MB | "
            f"{export[0]:.1f} s, {export[1]:,.0f} MB | {part[0]:.1f} s, {part[1]:,.0f} MB | "
            f"{len(planned.stages)} | {tokens:,.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(MODELS), help="models to run")
    parser.add_argument("--work", type=Path, help="folder for the files (default: a temporary)")
    args = parser.parse_args()
    print("| model | parameters | fp32 weights | ONNX + program | export (wall, peak RSS) "
          "| partition 8 x H100 (wall, peak RSS) | stages | predicted tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in args.only or list(MODELS):
            print(_row(name, work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
