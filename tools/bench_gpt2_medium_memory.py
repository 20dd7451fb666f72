"""GPT-2 medium's modelled training peak against FlagPerf's 30.2 GiB (issue 20).

    python tools/bench_gpt2_medium_memory.py [--batch-size 4] [--seq 1024] [--layers 24]
        [--precision [bf16] [fp16]]

Builds GPT-2 medium (transformers ``GPT2Config``: 24 layers, width 1024, 16 heads, vocabulary
50,257, 1,024 positions; eager attention, dropout 0.1 on, loss on) with random weights under
:class:`torch._subclasses.fake_tensor.FakeTensorMode`, so no memory is used and nothing is
downloaded, and counts what one training forward of one micro-batch saves for backward the way
:func:`onnx_partition.cost.saved.saved_by_module` does (unique storages, weights left out),
split into attention scores ``[b, heads, s, s]``, dropout masks, the loss's logits and the
rest. The memory model (:func:`onnx_partition.pipeline.memory.memory_parts`, one data-parallel
replica, one micro-batch in flight) prices it two ways:

* **ours (fp32)**: what ``partition --mode train`` models: fp32 weights, gradients and Adam's
  two moments (``optimizer_factor`` 4, 16 bytes per parameter), saved tensors as counted;
* **Megatron-equivalent**: the same saved set recounted as Megatron's fp16 mixed precision
  keeps it (floating tensors in 2 bytes, masks 1 byte; the loss's fp32 logits kept fp32) and
  18 bytes per parameter (fp16 parameter 2 + fp32 main gradient 4 + fp32 master parameter 4 +
  Adam's fp32 moments 8: Megatron-LM's distributed-optimizer documentation, the
  non-distributed "fp16 param, fp32 grads" row), i.e. ``optimizer_factor`` 4.5 over fp32
  parameter bytes;

* **the planner at ``--precision fp32``/``bf16``/``fp16``**: what ``partition --mode train
  --precision`` counts, :func:`onnx_partition.cost.saved.saved_bytes` of the model's exported
  program (with its loss) under autocast, by torch's CPU policy and by CUDA's applied op by op
  (:mod:`onnx_partition.cost.autocast`; a GPU plan's), priced as our trainer keeps the run
  (fp32 parameters, gradients and moments: 16 bytes per parameter) and, for the run FlagPerf
  makes, with Megatron's 18 bytes per parameter (``optimizer_factor`` 4.5);

then adds what ``nvidia-smi``'s "memory in use" counts besides the allocated peak (the CUDA
context; the caching allocator's reserve) and sets each against FlagPerf's figure.
Beside them, Korthikanti et al. 2022's closed form for a layer's activations in fp16,
``s*b*h*(34 + 5*a*s/h)`` bytes, checks the per-layer count.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from onnx_partition.cost.devices import CUDA_CONTEXT_GB
from onnx_partition.cost.saved import saved_bytes
from onnx_partition.pipeline.memory import StageBytes, memory_parts

GIB = 2.0**30
FLAGPERF_GIB = 30.2
#: CUDA context + cuBLAS workspace of a PyTorch process: what the memory model leaves out of a
#: named GPU's datasheet memory (:data:`onnx_partition.cost.devices.CUDA_CONTEXT_GB`, 0.5 GB).
CONTEXT_GIB = CUDA_CONTEXT_GB * 1e9 / GIB


def gpt2_medium(layers: int) -> Any:
    """GPT-2 medium's transformers config (``layers`` deep)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=1024, n_head=16, n_positions=1024,
                      vocab_size=50257, attn_implementation="eager")


def export_program(batch: int, seq: int, layers: int) -> Any:
    """GPT-2 medium with its loss, exported as ``onnx-partition export`` writes ``MODEL.pt2``
    (``torch.export``, non-strict), random weights: the program ``partition`` counts."""
    from transformers import GPT2LMHeadModel

    class WithLoss(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(ids, labels=ids).loss

    model = WithLoss(GPT2LMHeadModel(gpt2_medium(layers))).train()
    return torch.export.export(model, (torch.zeros(batch, seq, dtype=torch.long),),
                               strict=False)


def planner_saved(program: Any, batch: int, seq: int, precision: str, policy: str
                  ) -> tuple[int, dict[str, int]]:
    """The planner's own count: :func:`onnx_partition.cost.saved.saved_bytes` of the program
    (what ``partition --mode train --precision`` runs, FakeTensorMode) under autocast's
    ``policy`` (``cpu``: torch's CPU autocast; ``cuda``: CUDA's applied op by op), and its
    bytes by the aten op that saved them."""
    counted = saved_bytes(program, [(batch, seq)], precision=precision, policy=policy)
    targets = {n.name: getattr(getattr(n.target, "overloadpacket", None), "__name__",
                               str(n.target)) for n in program.graph.nodes}
    by_op: dict[str, int] = {}
    for node, nbytes in counted.per_node.items():
        by_op[targets[node]] = by_op.get(targets[node], 0) + nbytes
    return counted.total, by_op


def count_saved(batch: int, seq: int, layers: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """(parameters, saved bytes per kind as stored, the same kinds recounted for fp16)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import GPT2LMHeadModel

    config = gpt2_medium(layers)
    heads, vocab = config.n_head, config.vocab_size
    kinds = {"attention scores [b,a,s,s]": 0, "dropout masks": 0, "loss (logits)": 0,
             "rest of the layers": 0}
    half = dict(kinds)
    masks: set[Any] = set()

    class Masks(TorchDispatchMode):
        """Storages ``bernoulli_`` fills: dropout's masks. On CPU ``dropout`` keeps its mask
        in the input's dtype (``input * bernoulli(1-p) / (1-p)``); CUDA's fused
        ``native_dropout`` keeps a bool mask, 1 byte."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli):
                masks.add(StorageWeakRef(out.untyped_storage()))
            return out

    with FakeTensorMode():
        model = GPT2LMHeadModel(config)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        seen = {StorageWeakRef(t.untyped_storage())
                for t in [*model.parameters(), *model.buffers()]}
        ids = torch.zeros(batch, seq, dtype=torch.long)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = StorageWeakRef(t.untyped_storage())
            if key in seen:
                return t
            seen.add(key)
            n = int(t.untyped_storage().nbytes())
            if key in masks or t.dtype == torch.bool:
                kind, fp16 = "dropout masks", n // t.element_size()
            elif vocab in t.shape:
                # Megatron's cross entropy works on fp32 logits: they stay 4 bytes.
                kind, fp16 = "loss (logits)", n
            elif t.numel() == batch * heads * seq * seq:  # [b,a,s,s], or bmm's [b*a,s,s]
                kind, fp16 = "attention scores [b,a,s,s]", n * 2 // t.element_size()
            else:
                kind = "rest of the layers"
                fp16 = n * 2 // t.element_size() if t.is_floating_point() else n
            kinds[kind] += n
            half[kind] += fp16
            return t

        with Masks(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids)
    return params, kinds, half


def korthikanti_layer(batch: int, seq: int, width: int, heads: int) -> float:
    """Activation bytes of one transformer layer in fp16, no parallelism, no recomputation
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", eq. 1): ``s*b*h*(34 + 5*a*s/h)``."""
    return seq * batch * width * (34 + 5 * heads * seq / width)


def parts_row(label: str, parts: dict[str, int]) -> list[str]:
    acts = parts["activation_bytes"] * parts["inflight"]
    return [label, *(f"{parts[k] / GIB:.2f}" for k in
                     ("weights_bytes", "grad_bytes", "optimizer_bytes")),
            f"{acts / GIB:.2f}", f"{parts['memory_bytes'] / GIB:.2f}",
            f"{parts['memory_bytes'] / GIB / FLAGPERF_GIB:.2f}"]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reserve", type=float, default=0.10,
                        help="the caching allocator's reserved-but-free share over the "
                             "allocated peak, for the last row (default 0.10)")
    parser.add_argument("--precision", nargs="*", default=["fp16"], choices=["bf16", "fp16"],
                        help="the planner's own counts to add besides fp32 (partition "
                             "--precision; default fp16, FlagPerf's; none: skip the export)")
    args = parser.parse_args()
    start = time.perf_counter()
    params, kinds, half = count_saved(args.batch_size, args.seq, args.layers)
    counted = time.perf_counter() - start
    saved, saved16 = sum(kinds.values()), sum(half.values())
    print(f"GPT-2 medium: {params:,} parameters, {args.layers} layers, batch {args.batch_size} "
          f"x {args.seq} tokens; saved set counted under FakeTensorMode in {counted:.1f} s\n")
    print(table(["saved for backward, 1 micro-batch", "as stored (fp32), GiB",
                 "Megatron fp16, GiB"],
                [[k, f"{kinds[k] / GIB:.2f}", f"{half[k] / GIB:.2f}"] for k in kinds]
                + [["**total**", f"**{saved / GIB:.2f}**", f"**{saved16 / GIB:.2f}**"]]))
    per_layer = (kinds["attention scores [b,a,s,s]"] + kinds["dropout masks"]
                 + kinds["rest of the layers"]) / args.layers
    per_layer16 = (half["attention scores [b,a,s,s]"] + half["dropout masks"]
                   + half["rest of the layers"]) / args.layers
    closed = korthikanti_layer(args.batch_size, args.seq, 1024, 16)
    print(f"\nper layer (embedding's share included): counted fp32 {per_layer / 2**20:.0f} MiB, "
          f"recounted fp16 {per_layer16 / 2**20:.0f} MiB; Korthikanti et al. "
          f"s*b*h*(34+5as/h) = {closed / 2**20:.0f} MiB "
          f"(x{args.layers} = {closed * args.layers / GIB:.2f} GiB)\n")

    fp32 = StageBytes(params=4.0 * params, activations=float(saved))
    megatron = StageBytes(params=4.0 * params, activations=float(saved16))
    ours = memory_parts(fp32, 1, train=True, optimizer_factor=4.0)
    equiv = memory_parts(megatron, 1, train=True, optimizer_factor=4.5)
    in_use = equiv["memory_bytes"] / GIB + CONTEXT_GIB
    reserved = equiv["memory_bytes"] / GIB * (1 + args.reserve) + CONTEXT_GIB
    rows = [parts_row("ours: fp32, Adam (16 B/param)", ours),
            parts_row("Megatron-equivalent: fp16 + fp32 master (18 B/param), fp16 acts", equiv),
            [f"+ CUDA context {CONTEXT_GIB:.2f} GiB", "", "", "", "", f"{in_use:.2f}",
             f"{in_use / FLAGPERF_GIB:.2f}"],
            [f"+ allocator reserve {args.reserve:.0%} of the peak", "", "", "", "",
             f"{reserved:.2f}", f"{reserved / FLAGPERF_GIB:.2f}"],
            ["FlagPerf, memory in use (nvidia-smi)", "", "", "", "", f"{FLAGPERF_GIB:.2f}",
             "1.00"]]
    print(table(["model", "weights GiB", "grads GiB", "optimizer GiB", "activations GiB",
                 "peak GiB", "/ FlagPerf"], rows))
    if args.precision:
        began = time.perf_counter()
        program = export_program(args.batch_size, args.seq, args.layers)
        print(f"\nthe planner's own count (partition --mode train [--precision P]: saved_bytes "
              f"of the exported program, exported in {time.perf_counter() - began:.1f} s); "
              "cpu: torch's CPU autocast, cuda: CUDA's policy applied op by op\n")
        counts = {("fp32", "-"): planner_saved(program, args.batch_size, args.seq, "fp32",
                                               "cpu")}
        for precision in args.precision:
            for policy in ("cpu", "cuda"):
                counts[precision, policy] = planner_saved(program, args.batch_size, args.seq,
                                                          precision, policy)
        added = []
        for (precision, policy), (total, _) in counts.items():
            stage = StageBytes(params=4.0 * params, activations=float(total))
            own = memory_parts(stage, 1, train=True, optimizer_factor=4.0)
            flag = memory_parts(stage, 1, train=True, optimizer_factor=4.5)
            in_use = flag["memory_bytes"] / GIB + CONTEXT_GIB
            what = f"planner {precision}" + (f", {policy} autocast" if policy != "-" else "")
            added += [parts_row(f"{what} (16 B/param)", own),
                      parts_row(f"{what}, 18 B/param", flag),
                      [f"{what}, 18 B/param + context {CONTEXT_GIB:.2f} GiB", "", "", "", "",
                       f"{in_use:.2f}", f"{in_use / FLAGPERF_GIB:.2f}"]]
        print(table(["model", "weights GiB", "grads GiB", "optimizer GiB", "activations GiB",
                     "peak GiB", "/ FlagPerf"], added))
        ops = sorted({op for _, by_op in counts.values() for op in by_op},
                     key=lambda op: -max(c[1].get(op, 0) for c in counts.values()))
        keys = list(counts)
        print("\nsaved for backward by the aten op that saved it, GiB (ops above 0.05 GiB)\n")
        print(table(["op", *(f"{p} {q}" if q != "-" else p for p, q in keys)],
                    [[op, *(f"{counts[k][1].get(op, 0) / GIB:.2f}" for k in keys)]
                     for op in ops if max(c[1].get(op, 0) for c in counts.values()) > 0.05 * GIB]
                    + [["**total**", *(f"**{counts[k][0] / GIB:.2f}**" for k in keys)]]))
    needed = (FLAGPERF_GIB - CONTEXT_GIB) / (equiv["memory_bytes"] / GIB) - 1
    closed_peak = (4.5 * 4.0 * params + closed * args.layers + half["loss (logits)"]) / GIB
    print(f"\nreserve over the Megatron-equivalent peak that FlagPerf's figure implies: "
          f"{needed:.0%}; Korthikanti's closed form instead of our count (fused GELU): "
          f"{closed_peak:.2f} GiB allocated, {closed_peak + CONTEXT_GIB:.2f} GiB with the context")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
