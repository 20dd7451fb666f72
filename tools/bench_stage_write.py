"""Stage files against a plain copy of the same bytes: is ``partition``'s write at the disk's speed?

    python tools/bench_stage_write.py [--gib 1] [--stages 4] [--repeats 3] [--workdir DIR]

Builds a chain of ``MatMul`` nodes whose square float32 weights total ``--gib`` GiB, saved with
external data (``m.onnx.data``, as an exporter writes it), and partitions it into ``--stages``
stages with ``partition`` in this process; the time of its ``emit`` (every stage file and its
``.data``, the ONNX checker, the hashes, the manifest, plan.json, the fsyncs and the renames of
the atomic publication) is measured around the call. Against it: ``shutil.copyfile`` of
``m.onnx.data`` then an fsync of the copy, the same bytes. Each is run ``--repeats`` times,
alternately, each after an ``os.sync()``; the least time of each is shown, and their ratio
(the target is at most 1.5x).
Times are of this machine as it is: say its load with the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnx_partition.partition as partition_module  # noqa: E402
from onnx_partition.fileio import sync_file  # noqa: E402

WIDTH = 4096  # each weight is WIDTH x WIDTH float32: 64 MiB


def build(model: Path, gib: float) -> int:
    """The chain model at ``model`` with its weights in ``model.data``; the weights' bytes."""
    layers = max(1, round(gib * 2**30 / (WIDTH * WIDTH * 4)))
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for i in range(layers):
        name = f"w{i}"
        weights.append(numpy_helper.from_array(
            rng.standard_normal((WIDTH, WIDTH), dtype=np.float32), name))
        nodes.append(helper.make_node("MatMul", [f"x{i}", name], [f"x{i + 1}"], name=f"mm{i}"))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, [1, WIDTH])], weights)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    Path(str(model) + ".data").unlink(missing_ok=True)  # onnx appends to a data file there
    onnx.save_model(proto, str(model), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=model.name + ".data", size_threshold=1024)
    return layers * WIDTH * WIDTH * 4


def timed_partition(model: Path, out: Path, stages: int) -> float:
    """Seconds ``partition``'s ``emit`` took (stage files to published folder)."""
    spent: list[float] = []
    real_emit = partition_module.emit

    def emit(*args: object, **kwargs: object) -> object:
        began = time.perf_counter()
        try:
            return real_emit(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent.append(time.perf_counter() - began)

    partition_module.emit = emit  # type: ignore[assignment]
    try:
        partition_module.partition(model, stages, out, batch_size=1, force=True,
                                   exact_budget_s=0.0)
    finally:
        partition_module.emit = real_emit
    return spent[0]


def timed_copy(source: Path, target: Path) -> float:
    """Seconds of ``shutil.copyfile`` of ``source`` then an fsync of the copy."""
    began = time.perf_counter()
    shutil.copyfile(source, target)
    sync_file(target)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="weights, GiB")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="folder for the model and copies")
    args = parser.parse_args()
    if args.gib <= 0 or args.stages < 1 or args.repeats < 1:
        parser.error("--gib must be > 0, --stages and --repeats >= 1")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_stage_write."))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "m.onnx"
    size = build(model, args.gib)
    writes, copies = [], []
    for _ in range(args.repeats):  # both into new files: no earlier plan to delete
        shutil.rmtree(work / "plan", ignore_errors=True)
        os.sync()  # each starts with nothing of the other's left to write back
        writes.append(timed_partition(model, work / "plan", args.stages))
        os.sync()
        copies.append(timed_copy(Path(str(model) + ".data"), work / "copy.data"))
        assert (work / "copy.data").stat().st_size == size
        os.unlink(work / "copy.data")
    on_disk = sum(p.stat().st_size for p in (work / "plan").iterdir())
    write_s, copy_s = min(writes), min(copies)
    print(f"{size / 2**30:.2f} GiB of weights, {args.stages} stages, in {work}")
    print("| step | seconds (least of runs) | all runs | GB/s |")
    print("| --- | --- | --- | --- |")
    print(f"| stage files (emit, published) | {write_s:.2f} | "
          f"{', '.join(f'{s:.2f}' for s in writes)} | {on_disk / write_s / 1e9:.2f} |")
    print(f"| shutil.copyfile + fsync | {copy_s:.2f} | "
          f"{', '.join(f'{s:.2f}' for s in copies)} | {size / copy_s / 1e9:.2f} |")
    print(f"stage files / copy: {write_s / copy_s:.2f}x")
    if not args.workdir:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
