"""How much slower the whole program's forward and backward compute from cold caches
(``settings.cold_cache`` of ``profile --mode train``, cost/profile/cold_cache.py): thread CPU ms
warm (the profile's tight loop) and the cold / warm ratio after writing a buffer of twice the L2
and of twice the largest cache (what the profile measures), warm and cold taking turns round by
round, so that drift in the machine's speed weighs on both alike.

    python tools/bench_cold_cache.py [--models inception resnet gpt] [--size small]
        [--batch-size 2] [--repeats 30] [--workdir DIR]

Times are of this machine as it is: say its load with the figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from bench_train_predicted import exported
from torch.utils._pytree import tree_flatten

from onnx_partition.cost.profile.cold_cache import eviction_bytes, measure_cold_cache
from onnx_partition.cost.profile.torch_ops import _program_args, _record
from onnx_partition.graph import load

L2 = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")


def row(name: str, args: argparse.Namespace, work: Path) -> str:
    """The model's table row: warm ms and the cold / warm ratios at both eviction sizes."""
    model = exported(name, args.size, args.batch_size, work)
    program = torch.export.load(str(model.with_suffix(".pt2")))
    inputs, _ = _record(program, load(model, batch_size=args.batch_size), torch.device("cpu"))
    weights = _program_args(program, inputs, torch.device("cpu"))

    def loss() -> torch.Tensor:
        outs = [t for t in tree_flatten(program.graph_module(*weights))[0]
                if isinstance(t, torch.Tensor) and t.requires_grad]
        return sum((o.float().sum() for o in outs), torch.zeros(()))

    l2 = 2 * int(L2.read_text().strip().rstrip("K")) * 1024 if L2.is_file() else 4 * 2**20
    cells = []
    warm = None
    for size in (l2, eviction_bytes()):
        m = measure_cold_cache(loss, lambda t: t.backward(), repeats=args.repeats, warmup=3,
                               evict=size)
        warm = warm or m["cpu_ms"]["warm"]
        cells.append(f"{m['measured']['forward']:.2f} / {m['measured']['backward']:.2f}")
    assert warm is not None
    return f"| {name} | {warm[0]:.2f} / {warm[1]:.2f} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["inception", "resnet", "gpt"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cold-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"one torch thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"largest cache evicted by {eviction_bytes() >> 20} MiB; ratios cold / warm, "
          "forward / backward, medians of round-robin rounds\n")
    print("| model | warm CPU ms | cold/warm, 2x L2 evicted | cold/warm, 2x largest cache "
          "(the profile's) |")
    print("| --- | ---: | ---: | ---: |")
    for name in args.models:
        print(row(name, args, work), flush=True)


if __name__ == "__main__":
    main()
