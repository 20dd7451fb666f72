"""What a checkpoint costs: one rank's state (parameters of ``--mib`` MiB plus AdamW's two
moments) written as the training ranks write it (safetensors, atomically, then hashed and its
header indexed as rank 0 does), checked as a resume checks it before any rank starts, and read
back by name as a resuming rank reads it.

    python tools/bench_checkpoint.py --mib 256

Prints seconds and seconds per GB (of the file) for each part, the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from onnx_partition.fileio import atomic_path, sha256_file
from onnx_partition.runtime.train.checkpoint_state import load_rank_state, save_rank_state
from onnx_partition.safe_tensors import check_safetensors


def _model(mib: int) -> torch.nn.Module:
    side = 1024
    rows = max(1, mib * 2**20 // (4 * side * 16))
    return torch.nn.Sequential(*[torch.nn.Linear(side, rows, bias=False) for _ in range(16)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="parameter MiB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    module = _model(args.mib)
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    cpu = torch.device("cpu")
    times: dict[str, list[float]] = {"write": [], "hash + index": [], "check": [], "read": []}
    size = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "rank-00000.safetensors"
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            with atomic_path(path) as staged:
                save_rank_state(staged, module, optimizer, cpu, first_replica=True)
            t1 = time.perf_counter()
            entries = check_safetensors(path)
            sha256_file(path)
            index = {k: {"file": path.name, "shape": list(e.shape), "dtype": e.dtype}
                     for k, e in entries.items() if not k.startswith("rng/")}
            (folder / "manifest.json").write_text(json.dumps({"step": 1, "tensors": index}))
            t2 = time.perf_counter()
            sha256_file(path)
            check_safetensors(path)
            t3 = time.perf_counter()
            load_rank_state(folder, 0, module, optimizer, cpu, same_plan=True)
            t4 = time.perf_counter()
            size = path.stat().st_size
            for key, a, b in zip(times, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                times[key].append(b - a)
    gb = size / 1e9
    print(f"rank file {gb:.3f} GB ({args.mib} MiB parameters + AdamW state), "
          f"median of {args.repeats}")
    for key, values in times.items():
        s = statistics.median(values)
        print(f"{key:>13}: {s:.3f} s  ({s / gb:.2f} s/GB)")


if __name__ == "__main__":
    main()
