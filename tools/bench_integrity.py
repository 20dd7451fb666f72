"""What integrity costs: partitioning a model with one huge external weight (peak memory of the
block-wise copy), verifying the plan folder (sha256 throughput), and simulating with many
micro-batches (the bound on --microbatches).

    python tools/bench_integrity.py --weight-mib 1024

Each measurement runs in a fresh process; its peak RSS comes from ``wait4``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAKE = """
import numpy as np, onnx, sys
from onnx import helper
n = int(sys.argv[2])
raw = np.ones(n * n, np.float32)
w = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[n, n])
w.data_location = onnx.TensorProto.EXTERNAL
for k, v in (("location", "m.data"), ("offset", "0"), ("length", str(raw.nbytes))):
    e = w.external_data.add(); e.key, e.value = k, v
with open(sys.argv[1] + "/m.data", "wb") as f:
    for _ in range(n):
        f.write(raw[:n].tobytes())
g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["a"]),
                       helper.make_node("Relu", ["a"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", 1, ["N", n])],
                      [helper.make_tensor_value_info("y", 1, ["N", n])], [w])
model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
onnx.save(model, sys.argv[1] + "/m.onnx")
"""


def measured(argv: list[str]) -> tuple[float, float, int]:
    """(seconds, peak RSS MB, exit code) of one child process (``wait4``'s rusage)."""
    began = time.perf_counter()
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - began, usage.ru_maxrss / 1024.0, child.returncode


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnx_partition.cli", *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--weight-mib", type=int, default=1024)
    args = parser.parse_args()
    n = int((args.weight_mib * 2**20 / 4) ** 0.5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        folder = Path(tmp)
        subprocess.run([sys.executable, "-c", MAKE, str(folder), str(n)], check=True)
        mib = (folder / "m.data").stat().st_size / 2**20
        plan = folder / "plan"
        seconds, peak, code = measured(cli("simulate", "--help"))
        rows.append(("python + import (baseline)", f"{seconds:.2f}", f"{peak:.0f}", code))
        seconds, peak, code = measured(cli("partition", str(folder / "m.onnx"), "-s", "2",
                                           "--batch-size", "1", "-o", str(plan)))
        rows.append((f"partition, one {mib:.0f} MiB external weight", f"{seconds:.2f}",
                     f"{peak:.0f}", code))
        for flag in ("--no-verify", None):
            argv = cli("simulate", str(plan), *([flag] if flag else []))
            seconds, peak, code = measured(argv)
            what = "sizes only" if flag else "sizes + sha256"
            rows.append((f"simulate, verify {what} ({mib:.0f} MiB)", f"{seconds:.2f}",
                         f"{peak:.0f}", code))
        for count in (8, 512, 4096):
            seconds, peak, code = measured(cli("simulate", str(plan), "--no-verify",
                                               "--microbatches", str(count)))
            rows.append((f"simulate --microbatches {count}", f"{seconds:.2f}", f"{peak:.0f}",
                         code))
        seconds, peak, code = measured(cli("simulate", str(plan), "--microbatches",
                                           "100000000"))
        rows.append(("simulate --microbatches 100000000 (refused)", f"{seconds:.2f}",
                     f"{peak:.0f}", code))
        manifest = json.loads((plan / "plan.json").read_text())["manifest"]
    print("| step | seconds | peak RSS MB | exit |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(f"\nmanifest: {sorted(manifest)}")


if __name__ == "__main__":
    main()
