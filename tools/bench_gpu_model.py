"""GPT-2 medium on 8 GPUs: the planner's simulated iteration against published measurements.

    python tools/bench_gpu_model.py [--cache DIR] [--microbatches 16]

Plans GPT-2 medium (the realistic ``gpt`` recipe: 24 layers, width 1024, 16 heads, 50,257
tokens, 128-token context) for training on one machine of 8 GPUs (NVLink 300 GB/s, analytic
costs of the named GPU spec, :mod:`onnx_partition.cost.devices`), 1F1B, batch 8 per
micro-batch: the planner's own choice and fixed pipeline depths. The same model at a
1024-token context (FlagPerf's shape) is planned on 8 A100-SXM4-40GB at 4 samples per
micro-batch, where a published measurement of that very shape exists.

Published figure (FlagPerf, github.com/FlagOpen/FlagPerf, training/nvidia/gpt2-pytorch/README.md:
Megatron-LM's megatron-gpt2-345m, seq 1024, 4 samples per GPU, fp32 with TF32 matmuls in
NVIDIA's PyTorch container): 97.6 samples/s on one machine of 8 A100-SXM4-40GB, i.e. 12,493
tokens/s per GPU. For H100 it is carried over by the datasheet ratios of H100 SXM to A100 SXM
(bandwidth 3.35 / 1.555 = 2.15x to TF32 494.7 / 156 = 3.2x): 26,900-40,000 tokens/s per GPU.
Prints a Markdown table: simulated iteration, samples/s, tokens/s per GPU, the published
figure and the ratio (simulated / published; the target is within 2x, i.e. 0.5-2).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from onnx_partition.cost.annotate import annotate
from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.cost.devices import gpu
from onnx_partition.graph import load
from onnx_partition.graph_arrays import dag_problem
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec, node_arrays

NVLINK, NETWORK = Link(300.0, 0.005), Link(25.0, 0.02)
FLAGPERF_A100X8_SAMPLES_S = 97.6  # seq 1024, one machine of 8 A100-SXM4-40GB
H100_OVER_A100 = (3350 / 1555, 494.7 / 156)


def export_gpt(path: Path, seq: int) -> Path:
    """The realistic GPT recipe, at another context length when ``seq`` is not 128."""
    from onnx_partition.models import gpt
    from onnx_partition.models._export import export_recipe
    from onnx_partition.models._recipe import finish, input_generator, seeded

    from onnx_partition import models

    if path.exists():
        return path
    if seq == gpt.CONFIGS["realistic"].seq:
        return models.export("gpt", path, size="realistic")
    import dataclasses

    import torch

    cfg = dataclasses.replace(gpt.CONFIGS["realistic"], seq=seq)
    with seeded():
        module = gpt.GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (2, seq), generator=input_generator())
    return export_recipe(finish(module, {"input_ids": ids}, ["logits"]), path)


def problem_of(path: Path, batch: int, gpu_name: str) -> tuple[DagProblem, NodeArrays, float]:
    graph = load(path, batch_size=batch)
    costs = annotate(graph, device=gpu(gpu_name))
    problem, nodes = dag_problem(graph, costs.forward_ms, Link(NVLINK.bandwidth_gbps,
                                                               NVLINK.latency_ms))
    params = [float(graph.nodes[g].param_bytes) for g in nodes]
    arrays = node_arrays(problem, [costs.backward_ms[g] for g in nodes], params)
    return problem, arrays, sum(params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, help="keep the exported models here")
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        per_gpu_a100 = FLAGPERF_A100X8_SAMPLES_S * 1024 / 8
        cases = [  # (label, seq, batch per micro-batch, GPU, published tokens/s/GPU range)
            ("GPT-2 medium seq 128", 128, 8, "h100",
             tuple(per_gpu_a100 * r for r in H100_OVER_A100)),
            ("GPT-2 medium seq 1024", 1024, 8, "h100",
             tuple(per_gpu_a100 * r for r in H100_OVER_A100)),
            ("GPT-2 medium seq 1024", 1024, 4, "a100-40gb", (per_gpu_a100, per_gpu_a100)),
        ]
        print("| model | GPUs | batch / mb | M | stages | plan | simulated iteration ms | "
              "samples/s | tokens/s per GPU | published tokens/s per GPU | ratio | bubble |")
        print("| --- " * 12 + "|")
        for label, seq, batch, gpu_name, (low, high) in cases:
            path = export_gpt(cache / f"gpt-realistic-seq{seq}.onnx", seq)
            problem, arrays, _ = problem_of(path, batch, gpu_name)
            spec = gpu(gpu_name)
            cluster = Cluster(devices_per_machine=8, memory_gb=spec.memory_gb, kind="cuda",
                              gpu=gpu_name, intra=NVLINK, inter=NETWORK)
            run = RunSpec(cluster, train=True, microbatches=args.microbatches)
            for depth in (None, 2, 8):
                plan, _ = plan_cluster(problem, arrays, run, num_stages=depth)
                iteration = plan.sim.iteration_ms
                samples = args.microbatches * batch / iteration * 1e3
                tokens = samples * seq / 8
                ratio = (f"{tokens / high:.2f}" if low == high else
                         f"{tokens / high:.2f}-{tokens / low:.2f}")
                published = f"{low:,.0f}" if low == high else f"{low:,.0f}-{high:,.0f}"
                print(f"| {label} | 8 x {spec.name} | {batch} | {args.microbatches} | "
                      f"{'planner: ' if depth is None else ''}{plan.num_stages} | "
                      f"{plan.replicas} | {iteration:.1f} | {samples:.1f} | {tokens:,.0f} | "
                      f"{published} | {ratio} | {plan.sim.bubble_fraction * 100:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
