"""The planner's memory per stage against the stage files' count, over many random cuts.

For random models (``tests/support/graphs.relay_model``: skip tensors, inputs read late or
never, tied weights, copied constants, outputs made early, initializers as outputs) and the
tiny recipes, cuts each at random into 2 to 4 stages and counts every stage both ways
(``tests/support/memory.both_counts``): ``stage_sizes`` over the stage files' cuts, and the
planner's per-stage sums and interval tables. Prints how many stages disagree (any term or
the memory per device) and by how many bytes at most, then per term (weights, trainable
bytes, activations, received, sent) and place (first, interior or last stage) the same.

    python tools/memory_agreement.py [--models 150] [--cuts 4] [--recipes gpt bert encdec resnet]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.graphs import relay_model
from support.memory import PARTS, Inputs, both_counts, planner_inputs

from onnx_partition import models
from onnx_partition.graph import from_model, load
from onnx_partition.graph_arrays import trainable_parameters


def random_bounds(rng: np.random.Generator, n: int) -> list[int]:
    stages = int(rng.integers(2, min(4, n) + 1))
    inner = sorted(rng.choice(np.arange(1, n), size=stages - 1, replace=False).tolist())
    return [0, *inner, n]


def tally(inputs: Inputs, rng: np.random.Generator, cuts: int,
          rows: dict[tuple[str, str], list[float]], where: dict[str, list[float]],
          source: str) -> None:
    """Count ``cuts`` random cuts of one graph, train and infer, into ``rows`` (per source
    and mode: stages, disagreeing stages, max bytes) and ``where`` (per term and place)."""
    n = inputs.problem.num_nodes
    for _ in range(cuts):
        bounds = random_bounds(rng, n)
        last = len(bounds) - 2
        for mode in ("train", "infer"):
            counts = both_counts(inputs, bounds, train=mode == "train")
            found = counts.disagreements()
            row = rows[source, mode]
            row[0] += last + 1
            row[1] += len({k for k, _, _ in found})
            row[2] = max([row[2], *(abs(d) for _, _, d in found)])
            for k, part, diff in found:
                if part not in PARTS:  # the memory figures: their sums
                    continue
                place = "first" if k == 0 else "last" if k == last else "interior"
                sign = "planner more" if diff > 0 else "planner less"
                group = "random" if source == "random" else "recipes"
                cell = where[f"| {group} | {mode} | {part} | {place} | {sign} |"]
                cell[0] += 1
                cell[1] = max(cell[1], abs(diff))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=150, help="random models")
    parser.add_argument("--cuts", type=int, default=4, help="random cuts per model")
    parser.add_argument("--recipes", nargs="*", default=["gpt", "bert", "encdec", "resnet"])
    parser.add_argument("--recipe-cuts", type=int, default=25)
    args = parser.parse_args()
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    where: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for seed in range(args.models):
        rng = np.random.default_rng(seed)
        graph = from_model(relay_model(rng))
        names = sorted(graph.initializer_bytes)
        trainable = None if seed % 2 else {w for w in names if rng.random() < 0.6}
        tally(planner_inputs(graph, trainable), rng, args.cuts, rows, where, "random")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.recipes:
            model = models.export(name, Path(tmp) / f"{name}.onnx", size="tiny")
            graph = load(model, batch_size=2)
            tally(planner_inputs(graph, trainable_parameters(model)),
                  np.random.default_rng(0), args.recipe_cuts, rows, where, f"{name} tiny")
    print("| models | mode | stages | disagreeing stages | max bytes |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (source, mode), (stages, bad, most) in rows.items():
        print(f"| {source} | {mode} | {stages} | {bad} | {most:.0f} |")
    print()
    print("| models | mode | term | stage | planner | stages | max bytes |")
    print("| --- | --- | --- | --- | --- | ---: | ---: |")
    for label, (count, most) in sorted(where.items()):
        print(f"{label} {count} | {most:.0f} |")


if __name__ == "__main__":
    main()
