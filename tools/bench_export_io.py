"""What exporting a Llama with weights and writing its stage file cost: export seconds and peak
resident memory, bytes on disk (the ONNX file, its ``.onnx.data``, the program ``.pt2``; and the
program as the old layout saved it, with its weights, for comparison), then one stage file of the
whole model written by ``emit.save_stage`` against ``cp`` of the same data bytes.

    python tools/bench_export_io.py [--hidden 1536] [--layers 12] [--vocab 32000]
        [--intermediate 4096] [--workdir DIR] [--reuse]

Each step runs in its own process (peak RSS is that process's ``ru_maxrss``). Times are of this
machine as it is: say its load with the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_STAGE = """
import json, resource, sys, time
from pathlib import Path
from onnx_partition.graph import load
from onnx_partition.graph.emit import cut_stages, save_stage, stage_proto
model, out = Path(sys.argv[1]), Path(sys.argv[2])
graph = load(model, batch_size=1)
stage_of = dict.fromkeys(graph.compute_nodes, 0)
start = time.perf_counter()
cut = cut_stages(graph, stage_of, 1)[0]
save_stage(stage_proto(graph, cut, 0), out / "stage_0.onnx", model.parent, check=True)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak": peak}))
"""

_OLD = """
import json, resource, sys, time, torch
from onnx_partition.graph.program import load_program
program = load_program(sys.argv[1])
start = time.perf_counter()
torch.export.save(program, sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - start,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true",
                        help="keep the export already in --workdir (its figures too)")
    args = parser.parse_args()
    import transformers

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_export_io."))
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
        num_key_value_heads=8, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=256, architectures=["LlamaForCausalLM"])
    config.save_pretrained(work / "config")
    model = work / "m.onnx"
    cli = [sys.executable, "-m", "onnx_partition.cli", "export", "--hf-config",
           str(work / "config"), "--seq-len", "16", "-o", str(model)]
    start = time.perf_counter()
    if not (args.reuse and model.with_suffix(".pt2").is_file()):
        subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(work / "rss"), *cli], check=True)
        (work / "export_s").write_text(str(time.perf_counter() - start))
    seconds = float((work / "export_s").read_text())
    peak = int((work / "rss").read_text().split()[-1]) * 1024
    sizes = {p.name: p.stat().st_size for p in work.iterdir() if p.name.startswith("m.")}
    old = json.loads(subprocess.check_output(
        [sys.executable, "-c", _OLD, str(model.with_suffix(".pt2")), str(work / "old.pt2")]))
    params = sum(sizes.values()) - sizes["m.pt2"]
    stage_dir = work / "stage"
    stage_dir.mkdir(exist_ok=True)
    stage = json.loads(subprocess.check_output(
        [sys.executable, "-c", _STAGE, str(model), str(stage_dir)]))
    start = time.perf_counter()
    subprocess.run(["cp", str(model.with_name("m.onnx.data")), str(work / "copy.data")],
                   check=True)
    subprocess.run(["sync", "-f", str(work / "copy.data")], check=True)
    copy_s = time.perf_counter() - start
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
          f"{params / 4 / 1e9:.2f}B parameters (fp32), in {work}")
    print("| step | seconds | peak RSS | bytes on disk |")
    print("| --- | --- | --- | --- |")
    print(f"| export | {seconds:.1f} | {peak / 2**30:.2f} GiB | "
          + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in sorted(sizes.items())) + " |")
    print(f"| old layout's program (weights inside) | {old['seconds']:.1f} (save) | "
          f"{old['peak'] / 2**30:.2f} GiB | old.pt2 {(work / 'old.pt2').stat().st_size / 2**30:.3f}"
          " GiB |")
    data = sum(p.stat().st_size for p in stage_dir.iterdir())
    print(f"| stage file (1 stage, checked) | {stage['seconds']:.1f} | "
          f"{stage['peak'] / 2**30:.2f} GiB | {data / 2**30:.3f} GiB |")
    print(f"| cp + sync of m.onnx.data | {copy_s:.1f} | - | - |")
    print(f"stage write / cp: {stage['seconds'] / copy_s:.2f}x")


if __name__ == "__main__":
    main()
